"""The docs are true about the tree: CI runs the README's test command, paths the docs name
exist, and every "docs/SPEC.md §N" / "docs/FIELD_BUGS.md row N" reference resolves."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", ".snap", "__pycache__", ".pytest_cache", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".sh", ".txt", ".toml", ".yaml", ".yml", ""}
OWN_DOCS = ["README.md", "docs/SPEC.md", "docs/ARCHITECTURE.md", "docs/PERFORMANCE.md", "bench/README.md"]


def tree_files():
    """The tree's files: git's view (tracked and not ignored) when in a checkout, else a walk."""
    if (REPO / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True)
        if out.returncode == 0:
            for rel in out.stdout.splitlines():
                p = REPO / rel
                if p.suffix in TEXT_SUFFIXES and p.is_file() and p.stat().st_size < 2_000_000:
                    yield p
            return
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in files:
            p = Path(root) / f
            if p.suffix in TEXT_SUFFIXES and p.stat().st_size < 2_000_000:
                yield p


def readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r"# set up and run the tests \(what CI runs\)\n(.+)\n", text)
    assert m, "README.md: the test command block is missing"
    return m.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    cmd = readme_test_command()
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-1] == cmd, f".ci/run ends with {lines[-1]!r}, the README says {cmd!r}"
    assert "PATH" not in (REPO / ".ci" / "run").read_text()  # no help a new machine would lack


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_paths_named_in_the_docs_exist(doc):
    text = (REPO / doc).read_text()
    missing = []
    for name in re.findall(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-*<>{}]+)+/?)`", text):
        if any(c in name for c in "*<>{}") or name.startswith(("http", "/", "megamoe.", "v2/")):
            continue
        if "/" in name and not (REPO / name).exists() and not (REPO / Path(doc).parent / name).exists():
            missing.append(name)
    assert not missing, f"{doc} names paths that are not in the tree: {missing}"


def _sections(path: Path) -> set[str]:
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", path.read_text(), flags=re.M))


def _rows(path: Path) -> set[str]:
    return set(re.findall(r"^\| (\d+) \|", path.read_text(), flags=re.M))


def _references(pattern: str):
    for p in tree_files():
        if p.name == "test_docs.py":
            continue
        for m in re.finditer(pattern, p.read_text(errors="replace")):
            yield p.relative_to(REPO), m


def test_spec_references_resolve():
    sections = _sections(REPO / "docs" / "SPEC.md")
    assert {"1", "2", "3", "4", "5", "6"} <= sections
    bad = [f"{p}: §{m.group(1)}" for p, m in _references(r"docs/SPEC\.md §(\d+(?:\.\d+)*)")
           if m.group(1).rstrip(".") not in sections]
    assert not bad, f"references to sections docs/SPEC.md does not have: {bad}"


def test_field_bug_references_resolve():
    page = REPO / "docs" / "FIELD_BUGS.md"
    assert page.exists(), "docs/FIELD_BUGS.md is missing"
    rows = _rows(page)
    bad = []
    for p, m in _references(r"docs/FIELD_BUGS\.md rows? (\d+(?:(?:, | and | ?[-–/] ?)\d+)*)"):
        for n in re.findall(r"\d+", m.group(1)):
            if n not in rows:
                bad.append(f"{p}: row {n}")
    assert not bad, f"references to rows docs/FIELD_BUGS.md does not have: {bad}"


def test_no_references_to_files_outside_the_repository():
    old = [f"{p}: {m.group(0)!r}" for p, m in _references(r"(?<![\w/.])(?:SPEC §|FIELD_BUGS #?\d|shared/SPEC|shared/FIELD_BUGS)")]
    assert not old, f"cite docs/SPEC.md §N and docs/FIELD_BUGS.md row N instead: {old[:20]}"


@pytest.mark.parametrize("doc", OWN_DOCS + ["docs/TRITON_CLIENTS.md"])
def test_markdown_links_resolve(doc):
    """Every relative link of a doc ([text](target)) names a file or folder of the tree."""
    text = (REPO / doc).read_text()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = target.split("#", 1)[0]
        if path and not (REPO / Path(doc).parent / path).exists():
            bad.append(target)
    assert not bad, f"{doc} links to paths that are not in the tree: {bad}"


def test_readme_links_what_a_newcomer_looks_for():
    text = (REPO / "README.md").read_text()
    for target in ("docs/TRITON_CLIENTS.md", "bench/results/moe_h100.png", "bench/results/moe_h200.png",
                   "docs/PERFORMANCE.md", "docs/ARCHITECTURE.md"):
        assert f"]({target})" in text, f"README.md does not link {target}"
    assert "megamoe serve --checkpoint tests/fixtures/real/" in text  # a real-checkpoint serving example


def _readme_block(heading: str, lang: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"```{lang}\n(.*?)```", section, flags=re.S)
    assert m, f"README.md, {heading}: no {lang} block"
    return m.group(1)


def test_readme_library_snippet_runs():
    """The README's library example, as written, from the repository root (CPU: the torch backend)."""
    code = _readme_block("Using the library", "python")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quantized at load:" in r.stdout  # load_report.summary() printed


def test_readme_fault_injection_statement_is_what_selftest_reports():
    """README, Kernel health: with --inject-fault swapped-sf the SF round trip and the random-scale GEMM check fail,
    the uniform GEMM check and moe_cosine pass, moe_vs_reference is skipped on the torch backend, exit status 1."""
    text = " ".join((REPO / "README.md").read_text().split())
    assert "`sf_roundtrip` and `gemm_cosine_random` fail" in text and "`moe_cosine` and `moe_deepseek_v4` pass too" in text
    r = subprocess.run([sys.executable, "-m", "megamoe.cli", "selftest", "--backend", "torch", "--inject-fault",
                        "swapped-sf", "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    status = {c["name"]: c["status"] for c in json.loads(r.stdout)["checks"]}
    assert status == {"sf_roundtrip": "fail", "gemm_cosine_uniform": "pass", "gemm_cosine_random": "fail",
                      "moe_cosine": "pass", "moe_vs_reference": "skip", "moe_deepseek_v4": "pass"}, status


def test_performance_page_and_results_hold_the_current_state():
    """docs/PERFORMANCE.md is the reader's page (at most 200 lines), and bench/results/ keeps the latest record of
    each benchmark per GPU: the same-run A/B records of rejected variants live in git history."""
    assert len((REPO / "docs" / "PERFORMANCE.md").read_text().splitlines()) <= 200
    names = sorted(p.name for p in (REPO / "bench" / "results").iterdir())
    assert not [n for n in names if re.search(r"_ab_|_switch_|_queued", n)], names
    for gpu in ("h100", "h200"):
        assert f"moe_{gpu}.json" in names and f"moe_{gpu}.png" in names
