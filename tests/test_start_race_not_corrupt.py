"""One start id started on two hosts at the same instant: the loser never reads the run as corrupt.

Found by a two-host review: the loser's first read found no event (the winner had not
committed), then its check for a tree missing its first event read the winner's committed
events or index row and answered `store.corrupt` (`integrity.missing_event` at position 1,
"position 1 is missing (the first event stored is at position 1)"): 15-30% of the races on
PostgreSQL, through `Runtime.start` and `POST /runs`, for a run that `audit verify` found whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program
from tests.test_cli import ROOT


def _started_tree(url: str) -> TreeID:
    store = EventStore(url)
    program = chain_program(lambda request, context: Settlement.succeeded({"ok": True}), name="race.chain")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(program, {"n": 1}, start_id="raced")
            runtime.result(handle.tree_id, timeout=60)
            return handle.tree_id
    finally:
        store.close()


def test_a_tree_whose_first_append_commits_between_two_reads_is_read_whole(durable_store_url: str) -> None:
    # The race's window, made certain: the first read of position 1 answers as it did before
    # the winner's commit (nothing); every later read sees the committed tree.
    tree_id = _started_tree(durable_store_url)
    store = EventStore(durable_store_url)
    try:
        real_read = store.read
        calls: list[Any] = []

        def read_before_the_commit(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return [] if len(calls) == 1 else real_read(*args, **kwargs)

        store.read = read_before_the_commit  # type: ignore[method-assign]
        first = store.first_event(tree_id)
        assert first is not None and first.position == 1
        calls.clear()
        loaded = store.load(tree_id, use_snapshot=False)
        assert loaded.state.root.terminal and loaded.state.version > 1
    finally:
        store.close()


CHILD = r"""
import json, sys, time
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program

url, rounds, t0, spacing = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
program = chain_program(lambda request, context: Settlement.succeeded({"ok": True}), name="race.chain")
store = EventStore(url)
with Runtime(store, adopt_orphans_every=0) as runtime:
    for i in range(rounds):
        while time.time() < t0 + i * spacing:
            pass
        try:
            runtime.start(program, {"n": 1}, start_id=f"same-{i}")
            print(json.dumps({"i": i, "ok": True}), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"i": i, "code": getattr(exc, "code", type(exc).__name__), "message": str(exc)}), flush=True)
store.close()
"""


def test_two_processes_starting_one_start_id_at_once_get_the_run_or_in_progress(durable_store_url: str) -> None:
    rounds = 24
    EventStore(durable_store_url).close()  # the schema exists before the race
    t0 = time.time() + 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, durable_store_url, str(rounds), str(t0), "0.25"], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        outs.append(out)
    answers = [json.loads(line) for out in outs for line in out.splitlines()]
    assert len(answers) == 2 * rounds
    refused = [a for a in answers if "code" in a]
    assert all(a["code"] == "engine.start.in_progress" for a in refused), refused
    store = EventStore(durable_store_url)
    try:
        for i in range(rounds):  # one run per start id, whole
            tree_id = TreeID.for_start(StartID(f"same-{i}"))
            assert store.first_event(tree_id) is not None
    finally:
        store.close()
