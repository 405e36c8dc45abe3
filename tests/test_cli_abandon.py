"""A command that stops waiting exits, even while a tool call it started still hangs.

docs/cli.md: a call still running when a command stops waiting (``--timeout``, Ctrl-C) is
abandoned with the command, and whoever drives the tree next records it unknown. An audit
found the command reported ``cli.drive_failed`` after ``--timeout`` but stayed alive until
the tool returned (Python waits for its threads at exit), and that SIGINT did nothing until
the timeout. The tool here blocks for real: it opens a FIFO nobody reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import ROOT, agentfold, ok, sqlite_url
from tests.test_cli_interaction import FINAL, approval, logged_calls, one_tool_call, two_call_round, unknowns, write

#: The installed console script (what users run) and the module form the other tests use; and
#: a deployment's own console script written as docs/python.md shows it (``entry(SOURCES)``):
#: found by a review, the guide's ``sys.exit(main())`` waited at exit for the hung call.
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "agentfold")
DEPLOYMENT_SCRIPT = """\
from agentfold.adapters.cli import entry
from agentfold.adapters.sources import default_sources

SOURCES = default_sources()


def console() -> None:
    entry(SOURCES)


if __name__ == "__main__":
    console()
"""
ENTRIES = {"console-script": [CONSOLE_SCRIPT], "module": [sys.executable, "-m", "agentfold.adapters.cli"],
           "deployment-script": [sys.executable, "myapp_cli.py"]}


def hanging_scenario(tmp_path: Path) -> Path:
    fifo = tmp_path / "tool-log.fifo"
    os.mkfifo(fifo)
    doc = one_tool_call(fifo)  # the tool's side-effect log: opening a FIFO without a reader blocks
    path = tmp_path / "hang.json"
    path.write_text(json.dumps(doc))
    return path


def start(entry: str, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "myapp_cli.py").write_text(DEPLOYMENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(
        [*ENTRIES[entry], "run", str(hanging_scenario(tmp_path)), "--json", "--store", sqlite_url(tmp_path), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
        # As in a terminal's foreground job: a test run started in the background (`cmd &` in a
        # script) inherits SIGINT ignored, and Python then leaves it ignored.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen[str], within: float) -> tuple[int, str, float]:
    began = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the command was still running {within} s later (its tool call hangs)")
    return proc.returncode, err, time.monotonic() - began


def assert_abandoned_call_is_recorded_unknown(tmp_path: Path) -> None:
    ok(agentfold("recover", "--timeout", "10", store=sqlite_url(tmp_path)))
    (effect,) = json.loads(ok(agentfold("unknown", "--json", store=sqlite_url(tmp_path))).stdout)["unknown_effects"]
    assert effect["diagnostic"]["code"] == "engine.dispatch.interrupted", effect


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_command_past_its_timeout_exits_while_its_tool_call_hangs(entry: str, tmp_path: Path) -> None:
    if entry == "console-script" and not Path(CONSOLE_SCRIPT).exists():
        pytest.fail(f"{CONSOLE_SCRIPT} is not installed (scripts/test installs the project)")
    code, err, _ = finish(start(entry, tmp_path, "--timeout", "1"), within=20)
    assert code == 1, err
    assert json.loads(err.strip().splitlines()[-1])["error"]["code"] == "cli.drive_failed"
    assert_abandoned_call_is_recorded_unknown(tmp_path)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_ctrl_c_ends_a_command_at_once_while_its_tool_call_hangs(entry: str, tmp_path: Path) -> None:
    if entry == "console-script" and not Path(CONSOLE_SCRIPT).exists():
        pytest.fail(f"{CONSOLE_SCRIPT} is not installed (scripts/test installs the project)")
    proc = start(entry, tmp_path, "--timeout", "120")
    try:
        # Wait until the tool call is under way: its permission is the last event the run stores
        # before it blocks (version 16), and the tool opens the FIFO right after.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listed = agentfold("trees", "--json", store=sqlite_url(tmp_path))  # store.not_found until run makes it
            trees = json.loads(listed.stdout)["trees"] if listed.code == 0 else []
            if trees and trees[0]["version"] >= 16:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        code, err, took = finish(proc, within=20)
    finally:
        if proc.poll() is None:  # a failure above must not leave the command hanging on its FIFO
            proc.kill()
            proc.communicate()
    assert code == 130, err
    assert json.loads(err.strip().splitlines()[-1])["error"]["code"] == "cli.interrupted"
    assert took < 10, took
    assert_abandoned_call_is_recorded_unknown(tmp_path)


# ---------------------------------------------------------------------------
# A command that stops waiting records the calls that return and starts no new one


def test_timeout_0_leaves_a_tool_that_asks_a_human_waiting_for_the_answer_not_unknown(tmp_path: Path) -> None:
    # An audit found `run --timeout 0` abandoned the approval tool's call (it had not returned
    # yet): recover then recorded it unknown and the human was never asked.
    store = sqlite_url(tmp_path)
    ran = agentfold("run", str(write(tmp_path, approval(None))), "--timeout", "0", "--json", store=store)
    if ran.code == 1:
        # A loaded machine: the model call was still running at the timeout, so the approval
        # tool's call was declared and not started (CI saw this under load); the next owner
        # starts it, and the human is asked then. Never unknown, either way.
        error = json.loads(ran.stderr.strip().splitlines()[-1])["error"]
        assert error["code"] == "cli.drive_failed", error
        assert "were not started (the next owner starts them)" in error["message"], error
        assert unknowns(store) == []
        recovered = ok(agentfold("recover", "--json", store=store)).json()["trees"]
        assert [t["status"] for t in recovered] == ["waiting"], recovered
    else:
        assert ran.code == 0, ran.stderr
        assert json.loads(ran.stdout)["status"] == "waiting"
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]
    assert wait["prompt"] == {"question": "Approve spending 420 EUR?"}, wait
    assert unknowns(store) == []


def test_a_command_past_its_timeout_starts_no_new_call_and_the_next_owner_makes_them_once(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "tools.log"
    ran = agentfold("run", str(write(tmp_path, two_call_round(log, final=FINAL))), "--timeout", "0", "--json",
                    store=store)
    if ran.code == 1:  # the usual case: stopped with work left, declared and not started
        error = json.loads(ran.stderr.strip().splitlines()[-1])["error"]
        assert error["code"] == "cli.drive_failed", error
        assert "were not started (the next owner starts them)" in error["message"], error
        assert error["detail"]["tree_id"].startswith("tree:"), error  # a script need not parse the message
    else:  # the whole run finished before the command looked (a very fast machine)
        assert ran.code == 0, ran.stderr
    assert unknowns(store) == []  # nothing was abandoned: every call that began was recorded
    before = logged_calls(log)
    recovered = ok(agentfold("recover", "--json", store=store)).json()["trees"]
    assert [t["status"] for t in recovered] in ([], ["completed"])
    assert unknowns(store) == []
    assert sorted(logged_calls(log)) == ["call_a", "call_b"]  # each tool ran exactly once
    assert set(before) <= {"call_a", "call_b"}
