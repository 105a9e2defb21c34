#!/usr/bin/env bash
# The image's entry point: configuration checks that need the container's view of things,
# each failing with a line that says what to do, then `exec "$@"` (CMD: megamoe serve).
#  - MEGAMOE_CHECKPOINT must be a path inside the container (compose mounts the host folder
#    MEGAMOE_CHECKPOINT_DIR, default ./checkpoints, at /checkpoints).
#  - MEGAMOE_PUBLISHED_ADDRESS (compose sets it from MEGAMOE_BIND, the host address the port is
#    published on): anything but loopback needs MEGAMOE_TOKEN, or the service refuses to start.
set -euo pipefail

fail() {
  printf 'megamoe: %s\n' "$*" >&2
  exit 78  # EX_CONFIG: a configuration error, not a crash
}

ckpt="${MEGAMOE_CHECKPOINT:-}"
if [[ -n "$ckpt" && ! -e "$ckpt" ]]; then
  if [[ "$ckpt" != /checkpoints && "$ckpt" != /checkpoints/* ]]; then
    fail "MEGAMOE_CHECKPOINT=$ckpt does not exist inside the container; a path on the host is not visible" \
         "here. Compose mounts the host folder MEGAMOE_CHECKPOINT_DIR (default ./checkpoints) at /checkpoints:" \
         "set MEGAMOE_CHECKPOINT_DIR=$(dirname "$ckpt") and MEGAMOE_CHECKPOINT=/checkpoints/$(basename "$ckpt")," \
         "then docker compose up -d again."
  fi
  fail "MEGAMOE_CHECKPOINT=$ckpt does not exist: /checkpoints is the host folder MEGAMOE_CHECKPOINT_DIR" \
       "(default ./checkpoints); put the checkpoint there (ls it on the host), or fix the name, then" \
       "docker compose up -d again."
fi

published="${MEGAMOE_PUBLISHED_ADDRESS:-}"
if [[ -n "$published" && -z "${MEGAMOE_TOKEN:-}" ]]; then
  case "$published" in
    127.* | localhost | ::1 | "[::1]") ;;
    *)
      fail "refusing to serve on $published without a token: inference would be open to the network." \
           "Set MEGAMOE_TOKEN (clients send 'Authorization: Bearer <token>'), or publish on loopback" \
           "(MEGAMOE_BIND=127.0.0.1, the default)."
      ;;
  esac
fi

exec "$@"
