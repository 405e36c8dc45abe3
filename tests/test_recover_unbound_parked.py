"""``agentfold recover`` and runs whose Program this CLI does not bind.

A parked run (waiting for input) with nothing in flight is left as it is, bound or not: a
periodic ``recover`` in a deployment that binds other Programs must not fail for it (it
reported ``engine.program.unavailable`` and exited 1 on every call). A run of such a Program
with a call in flight still needs a worker that binds it: ``recover`` reports it and exits 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_cli import ROOT, agentfold

MAKE = """
import os, sys
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import asker_program, chain_program
store = EventStore(sys.argv[1])
if sys.argv[2] == "parked":
    program = asker_program()
    with Runtime(store, Catalog([program])) as runtime:
        runtime.wait_idle(runtime.start(program, None, start_id="parked-1").tree_id)
else:  # the process dies inside its first call: dispatched, never settled
    program = chain_program(lambda request, context: os._exit(75))
    Runtime(store, Catalog([program])).start(program, {"n": 2}, start_id="in-flight-1")
    import time; time.sleep(60)
"""


def make(store: str, kind: str) -> None:
    proc = subprocess.run([sys.executable, "-c", MAKE, store, kind], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == (0 if kind == "parked" else 75), proc.stderr


def versions(store: str) -> dict[str, int]:
    ran = agentfold("trees", "--json", store=store)
    assert ran.code == 0, ran.stderr
    return {t["start_id"]: t["version"] for t in json.loads(ran.stdout)["trees"]}


def test_a_parked_run_of_a_program_this_cli_does_not_bind_is_left_as_it_is(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    make(store, "parked")
    before = versions(store)
    for _ in range(2):  # a periodic recover
        ran = agentfold("recover", "--json", store=store)
        assert ran.code == 0, ran.stderr
        [entry] = json.loads(ran.stdout)["trees"]
        assert entry["start_id"] == "parked-1" and entry["outcome"] == "parked", entry
    assert versions(store) == before  # nothing appended


def test_a_run_of_an_unbound_program_with_a_call_in_flight_still_fails_recover(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    make(store, "parked")
    make(store, "in-flight")
    before = versions(store)
    ran = agentfold("recover", "--json", store=store)
    assert ran.code == 1, (ran.stdout, ran.stderr)
    outcomes = {t["start_id"]: t for t in json.loads(ran.stdout)["trees"]}
    assert outcomes["parked-1"]["outcome"] == "parked"
    assert outcomes["in-flight-1"]["outcome"] == "error", outcomes
    assert "engine.program.unavailable" in json.dumps(outcomes["in-flight-1"])
    assert versions(store) == before
