#!/usr/bin/env bash
# Installs NVIDIA Triton's load generator perf_analyzer into a virtual environment: the C++
# binary shipped in the tritonclient 2.48.0 wheel's data files (later wheels no longer carry
# it), the CUDA runtime library it links (from the nvidia-cuda-runtime-cu12 wheel; no GPU is
# needed to run it) and libb64 (Debian package libb64-0d). Prints the wrapper's path.
#   scripts/install_perf_analyzer.sh [VENV]      default VENV: .venv
# Files: VENV/perf_analyzer/{bin,lib} and the wrapper VENV/bin/perf_analyzer. The folder
# VENV/perf_analyzer runs on any x86-64 Linux machine with glibc (a GPU machine too).
set -euo pipefail
venv="$(cd "${1:-.venv}" && pwd)"
dest="$venv/perf_analyzer"
python="$venv/bin/python"
if [[ ! -x "$dest/bin/perf_analyzer" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" \
    "tritonclient==2.48.0" "nvidia-cuda-runtime-cu12==12.8.90" >&2
  mkdir -p "$dest/bin" "$dest/lib"
  "$python" - "$tmp" "$dest" <<'PY'
import pathlib, sys, zipfile
tmp, dest = map(pathlib.Path, sys.argv[1:])
wanted = {"tritonclient-2.48.0.data/data/bin/perf_analyzer": dest / "bin" / "perf_analyzer",
          "nvidia/cuda_runtime/lib/libcudart.so.12": dest / "lib" / "libcudart.so.12"}
for wheel in tmp.glob("*.whl"):
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name in wanted:
                wanted.pop(name).write_bytes(zf.read(name))
if wanted:
    sys.exit(f"not found in the downloaded wheels: {sorted(wanted)}")
PY
  chmod +x "$dest/bin/perf_analyzer"
fi
# ldconfig lives in /sbin, which a user's PATH need not contain
ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
if [[ ! -e "$dest/lib/libb64.so.0d" ]]; then
  found="$("$ldconfig" -p | awk '/libb64\.so\.0d/ && !n++ {print $NF}')"
  if [[ -z "$found" ]] && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    { apt-get install -y -q libb64-0d || { apt-get update -q && apt-get install -y -q libb64-0d; }; } >/dev/null 2>&1 || true
    found="$("$ldconfig" -p | awk '/libb64\.so\.0d/ && !n++ {print $NF}')"
  fi
  [[ -n "$found" ]] || { echo "libb64.so.0d is missing: install the Debian package libb64-0d" >&2; exit 1; }
  mkdir -p "$dest/lib" && cp -L "$found" "$dest/lib/libb64.so.0d"
fi
cat >"$venv/bin/perf_analyzer" <<'W'
#!/usr/bin/env bash
d="$(cd "$(dirname "$0")/../perf_analyzer" && pwd)"
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/bin/perf_analyzer" "$@"
W
chmod +x "$venv/bin/perf_analyzer"
usage="$("$venv/bin/perf_analyzer" --help 2>&1 || true)"  # it prints its usage and exits 1
grep -q "Usage:" <<<"$usage" || { echo "perf_analyzer does not start: ${usage:0:500}" >&2; exit 1; }
echo "$venv/bin/perf_analyzer"
