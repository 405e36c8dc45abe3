"""`serve --side-effect-dir DIR` confines every side-effect log the server appends to.

A scenario's tools append one JSON line per call to its ``side_effect_log``. A server
checks that path when a run is started over HTTP, but it also drives runs it never
validated (started by a CLI command on the same store, imported) and the file system may
change under a run it did validate. So each write is checked again: inside DIR as written,
opened one name at a time without following a symbolic link. A refused write settles the
tool call as ``rejected`` (nothing was done), which the run sees; the server goes on.
A refused path in ``POST /runs`` tells nothing about what lies outside DIR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentfold.adapters.scenario import (
    SideEffectLog,
    SideEffectLogRefused,
    side_effect_confinement,
    validate_scenario,
)
from agentfold.domain.errors import InvalidInput
from tests import forked_cli
from tests.http_api.support import ROOT, ApiServer, ok, problem, server_env, start_server
from tests.http_api.test_api import HELLO, pending_of, sid
from tests.test_cli_interaction import approval, one_tool_call


def cli(store: str, *args: str) -> Any:
    done = forked_cli.run([*args, "--store", store, "--json"], cwd=ROOT, env=server_env(None), timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tool_outputs(store: str, start_id: str) -> list[Any]:
    """What each tool call of the run settled with (the Tool child processes' outputs)."""
    shown = cli(store, "show", start_id)
    return [p["output"] for p in shown["processes"] if p["program"]["name"] == "agentfold.scenario.tools"]


def answer(c: httpx.Client, tree_id: str) -> dict[str, Any]:
    [wait] = pending_of(c, tree_id)
    data: dict[str, Any] = ok(c.post(f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer",
                                     json={"response": {"approved": True}, "wait": 30}))
    return data


def healthy(server: ApiServer) -> None:
    assert ok(httpx.get(server.url + "/health"))["status"] == "ok"
    assert "Traceback" not in server.logs(), server.logs()


def test_a_run_the_server_did_not_start_cannot_make_it_append_outside_its_side_effect_dir(tmp_path: Path) -> None:
    allowed, victim = tmp_path / "allowed", tmp_path / "victim"
    allowed.mkdir()
    victim.mkdir()
    target = victim / "target.log"
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    scenario = tmp_path / "evil.json"
    scenario.write_text(json.dumps(approval(target)))
    # A CLI command (not confined: its operator chose the file) runs until the tool asks a human.
    started = cli(store, "run", str(scenario), "--start-id", "evil-1")
    assert started["status"] == "waiting"
    before = target.read_text()
    assert before.count("\n") == 1
    server = start_server(store, tmp_path, "--side-effect-dir", str(allowed))
    try:
        c = server.client()
        done = answer(c, started["tree_id"])  # the server resumes the tool: its append is refused
        assert done["tree"]["status"] == "completed", done
        assert target.read_text() == before  # not one line more outside DIR
        [output] = tool_outputs(store, "evil-1")
        assert output["disposition"] == "rejected", output
        text = output["output"]["content"][0]["text"]
        assert "refused" in text and "outside this server's --side-effect-dir" in text, text
        assert ok(c.get(f"/runs/{started['tree_id']}/unknown-effects"))["unknown_effects"] == []
        healthy(server)
    finally:
        server.stop()


def test_a_log_replaced_by_a_symbolic_link_after_the_start_is_refused_at_the_next_write(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "outside.log"
    outside.write_text("")
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    server = start_server(store, tmp_path, "--side-effect-dir", str(allowed))
    try:
        c = server.client()
        data = ok(c.post("/runs", json={"scenario": approval(Path("race.log")), "start_id": "race-1", "wait": 30}),
                  201)
        assert data["tree"]["status"] == "waiting"
        race = allowed / "race.log"
        assert race.read_text().count("\n") == 1
        race.unlink()
        race.symlink_to(outside)  # swapped after the server checked the path
        done = answer(c, data["tree"]["tree_id"])
        assert done["tree"]["status"] == "completed", done
        assert outside.read_text() == ""
        [output] = tool_outputs(store, "race-1")
        assert output["disposition"] == "rejected", output
        assert "symbolic link" in output["output"]["content"][0]["text"], output
        assert str(outside) not in json.dumps(output)  # where the link leads is not told
        healthy(server)
    finally:
        server.stop()


LEAKS = ("/proc/", "socket:", "does not exist", "agentfold.db", "/root/.ssh'", "outside-target")


def test_a_refused_log_path_tells_nothing_about_the_servers_file_system(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "outside-target").mkdir()
    (allowed / "out").symlink_to(tmp_path / "outside-target")
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    server = start_server(store, tmp_path, "--side-effect-dir", str(allowed))
    try:
        c = server.client()
        for log in ("/proc/self/fd/6", "/proc/self/cwd/x", "/root/.ssh/x", "/no-such-folder/x", "../x.log"):
            refused = problem(c.post("/runs", json={"scenario": one_tool_call(Path(log)), "start_id": sid("leak")}),
                              422, "scenario.invalid")
            assert f"{log!r} is outside this server's --side-effect-dir" in refused["detail"], refused
            assert not any(leak in refused["detail"].replace(repr(log), "") for leak in LEAKS), refused
        # Inside DIR as written, but a link there leads out: refused without saying where to.
        for log in ("out/x.log", "out/missing/x.log"):
            refused = problem(c.post("/runs", json={"scenario": one_tool_call(Path(log)), "start_id": sid("leak")}),
                              422, "scenario.invalid")
            assert "leads outside this server's --side-effect-dir" in refused["detail"], refused
            assert not any(leak in refused["detail"] for leak in LEAKS), refused
        # The kernel demo's input names its log too.
        order = {"customer": "ada", "amount_cents": 100, "side_effect_log": "/proc/self/cwd/x"}
        refused = problem(c.post("/runs", json={"program": "demo.payment", "input": order}), 422,
                          "engine.start.input_invalid")
        assert not any(leak in refused["detail"].replace("'/proc/self/cwd/x'", "") for leak in LEAKS), refused
        # A folder inside DIR that is missing is still said to be missing (it is DIR's own business).
        refused = problem(c.post("/runs", json={"scenario": one_tool_call(Path("sub/x.log"))}), 422,
                          "scenario.invalid")
        assert "does not exist" in refused["detail"], refused
    finally:
        server.stop()
    bare = start_server(f"sqlite:///{tmp_path / 'other.db'}", tmp_path, side_effects=False)
    try:
        refused = problem(bare.client().post("/runs", json={"scenario": one_tool_call(Path("/root/.ssh/x"))}),
                          422, "scenario.invalid")
        assert "started without --side-effect-dir" in refused["detail"], refused
        assert "does not exist" not in refused["detail"], refused
        ok(bare.client().post("/runs", json={"scenario": HELLO, "start_id": sid("no-log")}), 201)
    finally:
        bare.stop()


# ---------------------------------------------------------------------------
# What one write checks (in this process, confined as `serve` confines itself)


def record(log: Path | str) -> None:
    SideEffectLog(str(log)).record("pay", "c1", "{}", "effect:x", False)


def test_each_write_is_checked_inside_the_folder_one_name_at_a_time(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "sub").mkdir()
    (outside / "victim.log").write_text("")
    with side_effect_confinement(allowed):
        record(allowed / "sub" / "ok.log")  # created inside, 0644
        assert (allowed / "sub" / "ok.log").read_text().count("\n") == 1
        assert (allowed / "sub" / "ok.log").stat().st_mode & 0o777 == 0o644
        for log, why in (
            (outside / "victim.log", "outside"),
            (allowed / ".." / "outside" / "victim.log", "outside"),  # `..` folded as written
            (allowed, "outside"),  # the folder itself is no file
        ):
            with pytest.raises(SideEffectLogRefused, match=why):
                record(log)
        (allowed / "link").symlink_to(outside)  # a folder link on the way
        with pytest.raises(SideEffectLogRefused, match="symbolic link"):
            record(allowed / "link" / "victim.log")
        (allowed / "sub" / "file-link.log").symlink_to(outside / "victim.log")
        with pytest.raises(SideEffectLogRefused, match="symbolic link"):
            record(allowed / "sub" / "file-link.log")
        os.link(outside / "victim.log", allowed / "hard.log")  # another name of a file outside
        with pytest.raises(SideEffectLogRefused, match="single link"):
            record(allowed / "hard.log")
        assert (outside / "victim.log").read_text() == ""
    # Outside the block (a CLI command): the path as it is, as before.
    record(allowed / "link" / "victim.log")
    assert (outside / "victim.log").read_text().count("\n") == 1


def test_a_process_confined_to_no_folder_appends_to_no_log_and_validates_none(tmp_path: Path) -> None:
    with side_effect_confinement(None):
        with pytest.raises(SideEffectLogRefused, match="without --side-effect-dir"):
            record(tmp_path / "x.log")
        with pytest.raises(InvalidInput, match="without --side-effect-dir"):
            validate_scenario(one_tool_call(Path("/root/.ssh/x")))
    assert not (tmp_path / "x.log").exists()


def test_the_kernel_demo_a_server_adopts_cannot_make_it_append_outside_its_side_effect_dir(tmp_path: Path) -> None:
    """The kernel demo's payment dispatcher appends to its log too: a run started by
    ``kernel-demo-run`` and killed after its charge is driven on by the server, whose receipt
    must not reach a log outside DIR (a definite failure, nothing was sent: the demo
    completes with ``receipt_sent: false``)."""
    allowed, victim = tmp_path / "allowed", tmp_path / "victim"
    allowed.mkdir()
    victim.mkdir()
    target = victim / "payments.jsonl"
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    env = server_env(None)
    crashed = forked_cli.run(["kernel-demo-run", "--side-effect-log", str(target), "--start-id", "pay-1",
                              "--crash-after", "settled:1", "--store", store], cwd=ROOT, env=env, timeout=120)
    assert crashed.returncode == 75, crashed.stderr
    before = target.read_text()
    assert [json.loads(line)["action"] for line in before.splitlines()] == ["charge"]
    server = start_server(store, tmp_path, "--side-effect-dir", str(allowed), "--recover")
    try:
        c = server.client()
        run = ok(c.get("/runs/pay-1", params={"wait": 0}))
        deadline = 60.0
        started = time.monotonic()
        while run["status"] != "completed" and time.monotonic() - started < deadline:
            time.sleep(0.1)
            run = ok(c.get("/runs/pay-1"))
        assert run["status"] == "completed", run  # the demo records a receipt that could not be sent
        assert run["output"]["receipt_sent"] is False, run
        assert "is outside this server's --side-effect-dir" in run["output"]["receipt"]["error"], run
        assert target.read_text() == before  # no receipt line outside DIR
        healthy(server)
    finally:
        server.stop()


def test_the_kernel_demo_reads_no_log_through_a_symbolic_link_in_a_server(tmp_path: Path) -> None:
    """Found by a review: before a receipt the demo reads its log (has this message gone out?),
    and it read it unconfined, through a link swapped in after the run started (a FIFO there
    would have held the call, /dev/zero filled the memory). Now it reads through the same
    confined descriptor it appends to: the receipt is refused and nothing outside is read."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    log = allowed / "pay.log"
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    crashed = forked_cli.run(["kernel-demo-run", "--side-effect-log", str(log), "--start-id", "pay-2",
                              "--crash-after", "settled:1", "--store", store], cwd=ROOT, env=server_env(None),
                             timeout=120)
    assert crashed.returncode == 75, crashed.stderr
    secret = outside / "secret.txt"
    secret.write_text("NOT JSON\n")
    log.unlink()
    log.symlink_to(secret)
    server = start_server(store, tmp_path, "--side-effect-dir", str(allowed), "--recover")
    try:
        c = server.client()
        started = time.monotonic()
        run = ok(c.get("/runs/pay-2"))
        while run["status"] != "completed" and time.monotonic() - started < 60:
            time.sleep(0.1)
            run = ok(c.get("/runs/pay-2"))
        assert run["status"] == "completed" and run["output"]["receipt_sent"] is False, run
        assert "symbolic link" in run["output"]["receipt"]["error"], run  # not a JSON error from reading it
        assert ok(c.get("/unknown-effects"))["unknown_effects"] == []
        assert secret.read_text() == "NOT JSON\n"
        healthy(server)
    finally:
        server.stop()


def test_the_server_says_at_its_start_where_side_effect_logs_go(tmp_path: Path) -> None:
    """An operator sees at the start whether scenario tools may log, and where: without
    --side-effect-dir the server appends to no log, which would otherwise surprise."""
    allowed = tmp_path / "logs"
    allowed.mkdir()
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    confined = start_server(store, tmp_path, "--side-effect-dir", str(allowed))
    try:
        assert confined.started["side_effect_dir"] == str(allowed.resolve())
    finally:
        assert confined.stop()[0] == 0
    # Without it (the line printed without --json): no log at all.
    proc = subprocess.Popen([sys.executable, "-m", "agentfold.adapters.cli", "serve", "--store", store, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=server_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agentfold: serving http://"), line
        assert "side-effect logs off: no --side-effect-dir" in line, line
        url = line.split()[2]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # serving: SIGTERM now stops it cleanly
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
