"""The set-up scripts under ``set -euo pipefail``: a pipeline whose reader stops early kills
its writer with SIGPIPE, and pipefail turns that into exit 141 with no message. These tests
run scripts/install_perf_analyzer.sh's library lookup against a stand-in ``ldconfig`` whose
listing is far larger than a pipe's buffer, with the wanted library on its first line.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_FAKE_LDCONFIG = """#!/usr/bin/env bash
echo "	libb64.so.0d (libc6,x86-64) => {lib}"
# 4 MiB more: ldconfig is still writing when a reader that stops at the first match exits
yes "	libfiller.so.1 (libc6,x86-64) => /nonexistent/libfiller.so.1" | head -c 4194304
echo
"""

_FAKE_PERF_ANALYZER = """#!/usr/bin/env bash
echo "Usage: perf_analyzer [options]"
exit 1
"""


def test_libb64_lookup_survives_a_long_ldconfig_listing(tmp_path):
    lib = tmp_path / "system" / "libb64.so.0d"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF stand-in for libb64\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    ldconfig = tools / "ldconfig"
    ldconfig.write_text(_FAKE_LDCONFIG.format(lib=lib))
    ldconfig.chmod(0o755)
    venv = tmp_path / "venv"
    pa = venv / "perf_analyzer" / "bin" / "perf_analyzer"  # present: the script skips the download
    pa.parent.mkdir(parents=True)
    pa.write_text(_FAKE_PERF_ANALYZER)
    pa.chmod(0o755)
    (venv / "bin").mkdir()

    env = {"PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path))}
    done = subprocess.run(["bash", str(REPO / "scripts" / "install_perf_analyzer.sh"), str(venv)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr[-2000:]}"
    assert done.stdout.strip().splitlines()[-1] == str(venv / "bin" / "perf_analyzer")
    copied = venv / "perf_analyzer" / "lib" / "libb64.so.0d"
    assert copied.read_bytes() == lib.read_bytes()
    wrapper = subprocess.run([str(venv / "bin" / "perf_analyzer"), "--help"], env=env, capture_output=True, text=True)
    assert "Usage:" in wrapper.stdout


def test_set_up_scripts_have_no_reader_that_stops_early():
    """A reader that exits before the end of its input (awk's exit, head, grep -q, sed q) behind
    a pipe, in a shell script that sets -e and pipefail, is the failure above waiting for a long
    enough input."""
    early = ("exit}", "| head", "| grep -q", "| grep -m", "q'")
    scripts = [s for s in sorted(REPO.rglob("*.sh")) if not {".venv", "build", ".git"} & set(s.relative_to(REPO).parts)]
    assert REPO / "scripts" / "install_perf_analyzer.sh" in scripts
    for script in [*scripts, REPO / ".ci" / "run"]:
        text = script.read_text()
        if "pipefail" not in text or "set -e" not in text:  # (set -eu, set -euo too)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if "|" in line and not line.lstrip().startswith("#"):
                assert not any(e in line for e in early), f"{script.name}:{number}: {line.strip()}"
