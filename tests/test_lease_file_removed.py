"""The SQLite lease file removed or replaced under a live owner (an operator cleaning up).

The owner's leases are locks on the file it opened. Once that file is gone from its path,
a process that opens the path creates a new file, finds no lock in it and used to take a
tree the live owner was driving: the call under way was declared unknown by someone else
and the live owner was fenced. Now the owner's watcher notices within a poll, opens the
file at the path again and takes its leases there: a later process finds them held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import CallLog, GatedCall, chain_program

ROOT = Path(__file__).resolve().parent.parent

ANOTHER_PROCESS = """
import json, sys
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import chain_program
program = chain_program(name="test.lease_file")
store = EventStore(sys.argv[1], create=False)
runtime = Runtime(store, Catalog([program]), poll_interval=0)
taken = [str(handle.tree_id) for handle in runtime.recover()]
tree = runtime.capture(store.index.select_heads()[0].tree_id)
unknown = [str(e.effect_id) for p in tree.processes.values() for e in p.unknown_effects()]
runtime.close()
store.close()
print(json.dumps({"taken": taken, "unknown": unknown}))
"""


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_lease_file_removed_under_a_live_owner_is_opened_again_and_excludes_later_processes(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    leases = tmp_path / "agentfold.db.leases"
    log = CallLog(str(tmp_path / "calls.jsonl"))
    gate = GatedCall(log, at=1)
    program = chain_program(gate, name="test.lease_file")
    store = EventStore(url)
    runtime = Runtime(store, Catalog([program]), poll_interval=0.05)
    try:
        handle = runtime.start(program, {"n": 3}, start_id="lease-file")
        assert gate.entered.wait(30)  # the second call is under way
        with caplog.at_level("WARNING", logger="agentfold.runtime"):
            if how == "removed":
                leases.unlink()
            else:
                (tmp_path / "new.leases").write_bytes(b"")
                os.replace(tmp_path / "new.leases", leases)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any("lease file" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
        [warning] = [r.getMessage() for r in caplog.records if "lease file" in r.getMessage()]
        assert "opened it again and took 1 of them there" in warning

        # Another process now finds the tree's lease held: it takes nothing and declares nothing.
        other = subprocess.run(
            [sys.executable, "-c", ANOTHER_PROCESS, url], capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert other.returncode == 0, other.stderr
        assert json.loads(other.stdout) == {"taken": [], "unknown": []}

        gate.release.set()
        result = handle.result(timeout=30)
        assert result.status == "completed" and result.output == {"total": 3, "effects": 3}
        assert [c["index"] for c in log.calls()] == [0, 1, 2]  # each call once
    finally:
        gate.release.set()
        runtime.close()
        store.close()


def test_read_commands_need_no_lease_file(tmp_path: Path) -> None:
    # Found by an operations review: with the `.leases` file unopenable (a directory at its
    # path, another user's, no inode left), `show` failed `store.unavailable` while `trees`,
    # `unknown`, `pending`, `audit verify` and `export` answered: it built a runtime (which
    # opens the lease file) only to find the tree. Reads never need a lease.
    from tests.test_cli import agentfold, ok

    url = f"sqlite:///{tmp_path / 's.db'}"
    ok(agentfold("kernel-demo-run", "--side-effect-log", str(tmp_path / "log"), "--start-id", "order-1", store=url))
    (tmp_path / "s.db.leases").unlink()
    (tmp_path / "s.db.leases").mkdir()
    for command in (["show", "order-1"], ["trees"], ["unknown"], ["pending"], ["audit", "verify", "--all"],
                    ["export", "order-1", "--out", str(tmp_path / "x.jsonl")]):
        ok(agentfold(*command, "--json", store=url))
    refused = agentfold("recover", "--json", store=url)  # a write still needs it, and says so
    assert refused.code == 1 and refused.error()["code"] == "store.unavailable", refused


def test_a_server_whose_lease_file_cannot_be_opened_again_is_unhealthy_until_it_can(
    tmp_path: Path, servers: list[Any]
) -> None:
    # Found by an operations review: the lease file removed under a server and not re-creatable
    # (no inode left) left `/health` at 200 `"leases": "ok"` while the server's leases, on a
    # file no other process opens, excluded nobody. A directory in its place stands for it here.
    from tests.http_api.support import start_server

    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    EventStore(url).close()
    server = start_server(url, tmp_path)
    servers.append(server)
    client = server.client()
    assert client.get("/health").status_code == 200
    leases = tmp_path / "agentfold.db.leases"
    leases.unlink()
    leases.mkdir()
    deadline = time.monotonic() + 20
    answer = client.get("/health")
    while answer.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        answer = client.get("/health")
    assert answer.status_code == 503, answer.text
    problem = answer.json()
    assert problem["code"] == "store.unavailable" and "lease file" in problem["detail"], problem
    # Nor does it take a run meanwhile (a lease on a file no other process opens excludes nobody).
    hello = {"name": "hello", "input": {"messages": [{"role": "user", "content": "Say hello."}]},
             "model": {"responses": [{"finish_reason": "stop", "message": {"content": "Hello."}}]}}
    refused = client.post("/runs", json={"scenario": hello, "start_id": "during", "wait": 10})
    assert refused.status_code == 503 and refused.json()["code"] == "store.unavailable", refused.text
    assert "lease file" in refused.json()["detail"]
    leases.rmdir()  # room again: the server opens it again by itself
    deadline = time.monotonic() + 20
    while answer.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        answer = client.get("/health")
    assert answer.status_code == 200 and answer.json()["leases"] == "ok", answer.text
    started = client.post("/runs", json={"scenario": hello, "start_id": "during", "wait": 10})
    assert started.status_code == 201 and started.json()["tree"]["status"] == "completed", started.text
