"""The installed package (wheel or editable) has one import name for the service:
``megamoe.service``. No generic top-level ``service`` module may be installed (any other
``service`` on the path would shadow it, or it would shadow theirs).

The wheel itself is built and inspected by docker/build.sh (tests/service/test_service_container.py
runs it); these tests check the project's mapping and the install this test run uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_maps_every_package_under_megamoe():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["scikit-build"]
    packages = config["wheel"]["packages"]
    assert isinstance(packages, dict), f"wheel.packages must map install names to folders, got {packages!r}"
    for target, source in packages.items():
        assert Path(target).parts[0] == "megamoe", f"wheel.packages installs {source!r} as top-level {target!r}"
    assert packages.get("megamoe/service") == "service", packages


_PROBE = r"""
import importlib.metadata, importlib.util, json, sys
report = {}
dist = importlib.metadata.distribution("megamoe")
report["top_level_files"] = sorted({str(f).split("/")[0] for f in dist.files or []})
# a redirecting editable finder (scikit-build-core) lists the module names it serves
served = set()
for finder in sys.meta_path:
    served.update(getattr(finder, "known_source_files", {}) or {})
report["served_service_names"] = sorted(n for n in served if n == "service" or n.startswith("service."))
spec = importlib.util.find_spec("megamoe.service")
report["megamoe_service_origin"] = spec.origin if spec else None
try:
    import service  # noqa: F401
    report["top_level_import"] = "imported from " + str(getattr(service, "__file__", None))
except ModuleNotFoundError as exc:
    report["top_level_import"] = "absent" if exc.name == "service" else "error: " + str(exc)
except ImportError as exc:
    report["top_level_import"] = "refused: " + str(exc)
import megamoe.service
report["main"] = callable(getattr(megamoe.service, "main", None))
print(json.dumps(report))
"""


def test_installed_package_exposes_no_top_level_service(tmp_path):
    # a neutral working directory: the checkout itself is not on sys.path through cwd
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "service" not in report["top_level_files"], f"the installed distribution has a top-level service/: {report}"
    assert report["served_service_names"] == [], f"the editable finder serves top-level service modules: {report}"
    origin = report["megamoe_service_origin"]
    assert origin and Path(origin).name == "__init__.py" and Path(origin).parent.name == "service", report
    # absent (a wheel), or refused: a checkout on sys.path (the editable install adds the
    # repository root) still must not give the service a second import name
    outcome = report["top_level_import"]
    assert outcome == "absent" or (outcome.startswith("refused: ") and "megamoe.service" in outcome), outcome
    assert report["main"] is True


def test_python_dash_m_megamoe_service_from_anywhere(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megamoe.service", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--preset" in out.stdout and "--backend" in out.stdout, out.stdout[:2000]
