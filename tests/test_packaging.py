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
import venv
import zipfile
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


USER_PROGRAM = """
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime

def tree_of(runtime: Runtime) -> int:
    store: EventStore = runtime.store
    return store  # a user's mistake that the types must catch
"""


def test_the_built_wheel_carries_its_data_and_its_types_for_a_users_type_checker(tmp_path: Path) -> None:
    """The wheel pip builds holds ``py.typed`` and the demo scenario, and mypy --strict checks a user's
    code against agentfold's annotations once the wheel is installed (without ``py.typed``, mypy
    refuses the import as an untyped library and sees every agentfold name as ``Any``)."""
    source = tmp_path / "source"  # a copy: a build/ folder left in the checkout would leak stale files into the wheel
    shutil.copytree(ROOT / "agentfold", source / "agentfold", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("agentfold-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert {"agentfold/py.typed", "agentfold/adapters/scenarios/demo.json"} <= names
        venv.create(tmp_path / "env", with_pip=False)
        python = tmp_path / "env" / "bin" / "python"
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        archive.extractall(site)
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # pydantic, eventsourcing, ...
    (tmp_path / "user.py").write_text(USER_PROGRAM)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable", str(python), "user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert 'Incompatible return value type (got "EventStore", expected "int")' in checked.stdout, checked.stdout
    assert "import-not-found" not in checked.stdout and "import-untyped" not in checked.stdout, checked.stdout
