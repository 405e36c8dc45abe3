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
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.kernel_demo import read_log
from tests import forked_cli

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")

pytestmark = pytest.mark.skipif(not forked_cli.enabled(), reason="AGENTFOLD_TEST_FORK=0: nothing is forked")


def fresh(argv: list[str], *, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120, check=False)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def both(argv: list[str], tmp_path: Path, **extra: str) -> tuple[Any, Any]:
    env = environment(**extra)
    return forked_cli.run(argv, env=env, cwd=tmp_path), fresh(argv, env=env, cwd=tmp_path)


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
        old = os.umask(0o077)
        try:
            argv = ["run", DEMO, "--start-id", "trip", "--json"]
            ran = forked_cli.run(argv, env=environment(), cwd=here) if how == "forked" else \
                fresh(argv, env=environment(), cwd=here)
        finally:
            os.umask(old)
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["status"] == "waiting"
        modes[how] = stat.S_IMODE((here / "agentfold.db").stat().st_mode)  # the default store, in cwd
        elsewhere = f"sqlite:///{here / 'elsewhere.db'}"
        listed = forked_cli.run(["trees", "--json"], env=environment(AGENTFOLD_STORE=elsewhere), cwd=here)
        assert listed.returncode == 2 and "elsewhere.db" in listed.stderr, listed.stderr  # $AGENTFOLD_STORE read
    assert modes == {"forked": 0o600, "fresh": 0o600}


def test_a_crash_point_is_a_real_process_death_with_its_exit_status(tmp_path: Path) -> None:
    for how in ("forked", "fresh"):
        log = tmp_path / f"{how}.log"
        argv = ["kernel-demo-run", "--start-id", "order-1", "--side-effect-log", str(log), "--crash-after",
                "in-dispatch:1", "--store", f"sqlite:///{tmp_path / how}.db"]
        ran = forked_cli.run(argv, env=environment(), cwd=tmp_path) if how == "forked" else \
            fresh(argv, env=environment(), cwd=tmp_path)
        assert ran.returncode == 75, (how, ran.stderr)
        assert [line["action"] for line in read_log(log)] == ["charge"], how


def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    assert forked_cli.run(["run", DEMO, "--start-id", "trip", "--store", url], env=environment(),
                          cwd=tmp_path).returncode == 0
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked_cli.run(["project", "--follow", "--store", url], env=environment(), cwd=tmp_path, timeout=3)
    assert time.monotonic() - began < 30
    # Killed: the next command of the same launcher answers.
    assert forked_cli.run(["trees", "--store", url], env=environment(), cwd=tmp_path).returncode == 0
