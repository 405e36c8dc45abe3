"""tests/forked_cli.py runs most of the suite's ``agentfold`` commands in processes forked from
a launcher that imported agentfold once. What a test observes of such a command must be what
it observes of a fresh interpreter (``python -m agentfold.adapters.cli``): output, exit status,
files made where the environment, directory and umask say, a crash's real process death.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.kernel_demo import read_log
from tests import forked_cli
from tests.http_api.support import wait_until

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")

pytestmark = pytest.mark.skipif(not forked_cli.enabled(), reason="AGENTFOLD_TEST_FORK=0: nothing is forked")


def fresh(argv: list[str], *, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120, check=False)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def run(how: str, argv: list[str], *, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    if how == "fresh":
        return fresh(argv, env=environment(**extra), cwd=cwd)
    ran = forked_cli.run(argv, env=environment(**extra), cwd=cwd)
    assert ran.args[0] == "agentfold", ran.args  # forked, not a fresh interpreter
    return ran


def both(argv: list[str], tmp_path: Path) -> tuple[Any, Any]:
    return run("forked", argv, cwd=tmp_path), run("fresh", argv, cwd=tmp_path)


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["trees", "--store", "bogus:"],
    ["trees", "--json", "--store", "bogus:"],
    ["no-such-command"],
    ["resolve", "effect:nope", "--failure", "x", "--store", "memory:"],
])
def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter(argv: list[str], tmp_path: Path) -> None:
    forked, started = both(argv, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (started.returncode, started.stdout, started.stderr)


def test_the_environment_directory_and_umask_are_the_callers(tmp_path: Path) -> None:
    modes = {}
    for how in ("forked", "fresh"):
        here = tmp_path / how
        here.mkdir()
        ran = run(how, ["run", DEMO, "--start-id", "trip", "--json"], cwd=here)
        assert ran.returncode == 0, ran.stderr
        assert (here / "agentfold.db").exists()  # the default store, in the working directory
        tree_id = json.loads(ran.stdout)["tree_id"]
        old = os.umask(0o027)
        try:
            exported = run(how, ["export", tree_id, "--out", "tree.jsonl"], cwd=here)
        finally:
            os.umask(old)
        assert exported.returncode == 0, exported.stderr
        modes[how] = stat.S_IMODE((here / "tree.jsonl").stat().st_mode)  # a plain write's mode: 0666 & ~umask
        elsewhere = f"sqlite:///{here / 'elsewhere.db'}"
        listed = run(how, ["trees", "--json"], cwd=here, AGENTFOLD_STORE=elsewhere)
        assert listed.returncode == 2 and "elsewhere.db" in listed.stderr, listed.stderr  # $AGENTFOLD_STORE read
    assert modes == {"forked": 0o640, "fresh": 0o640}


def test_a_crash_point_is_a_real_process_death_with_its_exit_status(tmp_path: Path) -> None:
    for how in ("forked", "fresh"):
        log = tmp_path / f"{how}.log"
        ran = run(how, ["kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(log), "--crash-after",
                        "in-dispatch:1", "--store", f"sqlite:///{tmp_path / how}.db"], cwd=tmp_path)
        assert ran.returncode == 75, (how, ran.stderr)
        assert [line["action"] for line in read_log(log)] == ["charge"], how


def processes_in(folder: Path) -> list[int]:
    """The processes whose working directory is ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "cwd") == str(folder):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_a_command_past_its_timeout_is_killed_before_the_caller_goes_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    assert run("forked", ["run", DEMO, "--start-id", "trip", "--store", url], cwd=tmp_path).returncode == 0
    here = tmp_path / "follower"
    here.mkdir()
    seen: list[list[int]] = []
    watcher = threading.Thread(target=lambda: seen.append(wait_until(lambda: processes_in(here), 4)), daemon=True)
    watcher.start()
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_cli.run(["project", "--follow", "--store", url], env=environment(), cwd=here, timeout=4)
    assert time.monotonic() - began < 30
    watcher.join(10)
    assert seen and seen[0], "the follower was never seen running"
    assert processes_in(here) == []  # killed and reaped when TimeoutExpired is raised
    assert run("forked", ["trees", "--store", url], cwd=tmp_path).returncode == 0

