"""The command line, as a user runs it."""
import json
import subprocess
import sys

import pytest

from megamoe import cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "megamoe.cli", *args], capture_output=True, text=True, timeout=600)


def test_help_answers():
    r = run("--help")
    assert r.returncode == 0
    for word in ("selftest", "synth", "serve", "info"):
        assert word in r.stdout
    r = run("selftest", "--help")
    assert r.returncode == 0 and "--inject-fault" in r.stdout and "Exit status" in r.stdout


def test_selftest_passes_and_fails_with_exit_codes():
    ok = run("selftest", "--backend", "torch", "--json", "--seed", "5")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["status"] == "pass"
    bad = run("selftest", "--backend", "torch", "--inject-fault", "swapped-sf", "--seed", "5")
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout and "overall: FAIL" in bad.stdout


def test_selftest_unknown_backend_is_usage_error(capsys):
    assert cli.main(["selftest", "--backend", "tpu"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_synth_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "c.safetensors"
    r = run("synth", "--preset", "tiny", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.exists() and "quantized at load: none" in r.stdout
    assert "synthesizing" in r.stderr  # the progress bar
    assert run("synth", "--preset", "nope", "--out", str(out)).returncode == 2


def test_info_lists_backends():
    r = run("info")
    assert r.returncode == 0
    assert "torch" in r.stdout and "cuda-sm90" in r.stdout and "cuda-sm100" in r.stdout


def test_top_level_help_is_plain_text():
    out = run("--help").stdout
    assert out.startswith("usage: megamoe")
    for markup in ("``", ":func:", ":class:", "`"):
        assert markup not in out, markup
    assert "docs/SPEC.md §5" in run("selftest", "--help").stdout


def test_version_is_the_package_version():
    import megamoe

    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"megamoe {megamoe.__version__}"


def test_synth_help_names_the_format_it_writes(tmp_path):
    from megamoe import checkpoint

    text = " ".join(run("synth", "--help").stdout.split())
    assert "megamoe's own format" in text and "not a ModelOpt export" in text
    assert "ModelOpt-format" not in text
    out = tmp_path / "t.safetensors"
    assert run("synth", "--preset", "tiny", "--quiet", "--out", str(out)).returncode == 0
    assert checkpoint.load(out).report.format == "megamoe"  # what the help says it writes
