"""Container health probe: exit 0 when the server's readiness endpoint answers 200.

Used by the image's HEALTHCHECK, by compose.yaml and by docker/build.sh smoke, so
the probe CI runs is the probe the orchestrator runs. Standard library only.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("MEGAMOE_PORT", "8000")
    url = os.environ.get("MEGAMOE_HEALTH_URL", f"http://127.0.0.1:{port}/v2/health/ready")
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("MEGAMOE_HEALTH_TIMEOUT_S", "4"))) as reply:
            return 0 if reply.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"not ready: {exc.code} {exc.read()[:300]!r}", file=sys.stderr)
    except OSError as exc:
        print(f"no answer from {url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
