"""agentfold installs one top-level package, ``agentfold``: a project with packages of its own
named ``domain``, ``adapters`` or ``projections`` (common names) imports both its own and
agentfold's.

Before, agentfold installed those three names at the top level: in a regular (not editable)
install, a user's ``domain`` package shadowed agentfold's (``ModuleNotFoundError: No module
named 'domain.canonical'``), or agentfold's shadowed the user's. The test lays agentfold out
as a regular install does (the package copied into a site directory, no editable finder:
``python -S``) and runs it from a project folder with those three packages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, domain, adapters, projections
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.cli import main
store = EventStore("memory:")
store.close()
code = main(["--store", "memory:", "trees", "--json"])
print(json.dumps({"exit": code, "mine": [domain.MINE, adapters.MINE, projections.MINE]}))
"""


def test_a_project_with_its_own_domain_adapters_and_projections_packages_runs_agentfold(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(ROOT / "agentfold", site / "agentfold", ignore=shutil.ignore_patterns("__pycache__"))
    project = tmp_path / "project"
    for name in ("domain", "adapters", "projections"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"MINE = {name!r}\n")
    (project / "probe.py").write_text(PROBE)
    dependencies = sysconfig.get_paths()["purelib"]
    ran = subprocess.run(
        [sys.executable, "-S", "probe.py"], cwd=project, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{site}:{dependencies}", "PATH": "/usr/bin:/bin"},
    )
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out == {"exit": 0, "mine": ["domain", "adapters", "projections"]}
