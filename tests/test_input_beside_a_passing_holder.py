"""Input recorded while another runtime held the tree's lease only for a moment is driven on.

A host's request on a run nobody drives takes the run over (one append: the activation and
the request). When another runtime held the lease at that instant, the request was recorded
as stored for the lease's holder to apply. Found by a review with two real ``agentfold
resolve`` processes: that holder was only passing through (the other command, whose own
takeover was then refused: the first one's resolution had made it moot; or a ``recover``
looking whether the parked run needed driving), it let go, and nobody drove the run. The CLI
said "another runtime owns this tree and drives it on" while none did; the run waited for
``recover``. Here the holder is a lease taken by the test process, let go once the input is
recorded: the request's runtime takes the run over then (a CLI command within its short
tries, a runtime with a watcher at its polls).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import ControlRequested, TreeEvent, WriterActivated
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import Settlement
from tests.kernel_programs import CallLog, GatedCall, chain_program
from tests.test_cli import agentfold, ok, sqlite_url
from tests.test_cli_interaction import approval, run_json, write
from tests.test_orphan_adoption import orphaned_chain


def parked_on_an_unknown(url: str, log: CallLog) -> tuple[TreeID, str, Any]:
    """A two-call chain whose owner died inside its first call, recovered by another runtime
    (the call is unknown) that closed: parked, nobody owns it. (tree, the unknown effect, program)"""
    gate = GatedCall(log)
    tree_id = orphaned_chain(url, gate, start_id="passing-holder")
    gate.release.set()
    program = chain_program(gate, name="orphan.chain")
    with Runtime(EventStore(url), Catalog([program]), poll_interval=0) as recovering:
        recovering.recover(tree_id)
        tree = recovering.wait_idle(tree_id, timeout=30)
    [effect] = [e for p in tree.processes.values() for e in p.unknown_effects()]
    return tree_id, str(effect.effect_id), program


def hold_until_recorded(
    url: str, tree_id: TreeID, then_for: float, until: type[TreeEvent] | None = None
) -> tuple[threading.Thread, list[str]]:
    """Take the tree's lease here (another process's, as far as any runtime can tell); let it
    go ``then_for`` seconds after the next append to the tree lands (with ``until``: after an
    event of that type lands)."""
    store = EventStore(url)
    leases = store.leases()
    assert leases.acquire(tree_id)
    head = store.head(tree_id)
    assert head is not None
    before = head.version
    problems: list[str] = []

    def let_go() -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                now = store.head(tree_id)
                if now is not None and now.version > before and (
                    until is None or any(isinstance(r.event, until) for r in store.read(tree_id)[before:])
                ):
                    break
                time.sleep(0.005)
            else:
                problems.append("the input was never recorded")
            time.sleep(then_for)
        finally:
            leases.release(tree_id)
            leases.close()
            store.close()

    thread = threading.Thread(target=let_go, daemon=True)
    thread.start()
    return thread, problems


def activations(url: str, tree_id: TreeID) -> int:
    store = EventStore(url, create=False)
    try:
        return sum(isinstance(e.event, WriterActivated) for e in store.read(tree_id))
    finally:
        store.close()


@pytest.mark.parametrize(("poll_interval", "held_for"), [(0, 0.03), (0.05, 0.6)], ids=["no-watcher", "watcher"])
def test_a_runtime_takes_the_run_over_once_the_holder_lets_go(
    durable_store_url: str, tmp_path: Path, poll_interval: float, held_for: float,
) -> None:
    """Without a watcher (a CLI command), within its short tries; with one, at its polls (the
    lease held longer than a command's tries), the request not held up meanwhile."""
    log = CallLog(tmp_path / "calls.jsonl")
    tree_id, effect_id, program = parked_on_an_unknown(durable_store_url, log)
    before = activations(durable_store_url, tree_id)
    holder, problems = hold_until_recorded(durable_store_url, tree_id, then_for=held_for)
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=poll_interval) as host:
        host.resolve_unknown_effect(effect_id, Settlement.succeeded({"value": 1}))
        # Before: recorded, never driven (owns: False), and `result` waited for a run nobody drove.
        assert host.owns(tree_id) is (poll_interval == 0)
        holder.join(30)
        assert not problems, problems
        assert host.result(tree_id, timeout=20).status == "completed"
    assert log.count() == 2  # the unknown first call, made once; the second, once
    assert activations(durable_store_url, tree_id) == before + 1


def test_a_cli_answer_drives_the_run_once_a_passing_holder_lets_go(tmp_path: Path) -> None:
    """Real processes: ``agentfold answer`` while the test process holds the lease for a moment."""
    store = sqlite_url(tmp_path)
    side_effects = tmp_path / "side-effects.jsonl"
    started = run_json(store, write(tmp_path, approval(side_effects)), "--start-id", "passing-1")
    assert started["status"] == "waiting"
    tree_id = TreeID(started["tree_id"])
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]
    holder, problems = hold_until_recorded(store, tree_id, then_for=0.03)
    answered = ok(agentfold("answer", wait["process_id"], wait["wait_id"], '{"approved": true}', "--json",
                            store=store)).json()
    holder.join(30)
    assert not problems, problems
    # Before: driven false ("another runtime owns this tree and drives it on"), status running,
    # and the run stayed there.
    assert answered["driven"] is True, answered
    assert answered["tree"]["status"] == "completed", answered
    # The tool ran once to ask and once, resumed here, to finish with the answer.
    assert [json.loads(line)["resumed"] for line in side_effects.read_text().splitlines()] == [False, True]


def test_more_input_from_another_host_does_not_end_the_tries(durable_store_url: str, tmp_path: Path) -> None:
    """Found by the review of this change: a second host's input moved the version past the
    first's, which took it for an owner's work and stopped trying; nobody drove the run."""
    log = CallLog(tmp_path / "calls.jsonl")
    tree_id, effect_id, program = parked_on_an_unknown(durable_store_url, log)
    before = activations(durable_store_url, tree_id)
    # The lease is held until the second host's cancel is recorded too (and 1 s more): under load
    # a hold timed from the resolution alone could end first, and the run complete uncanceled.
    holder, problems = hold_until_recorded(durable_store_url, tree_id, then_for=1.0, until=ControlRequested)
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0.05) as host:
        host.resolve_unknown_effect(effect_id, Settlement.succeeded({"value": 1}))
        root = host.capture(tree_id).root_id
        assert root is not None
        with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as other:
            assert other.cancel(root) is True
            assert not other.owns(tree_id)  # the holder still holds the lease
        holder.join(30)
        assert not problems, problems
        # Before: never taken over; the resolution and the cancel stayed undriven.
        assert host.result(tree_id, timeout=20).status == "canceled"
    assert activations(durable_store_url, tree_id) == before + 1
    assert log.count() == 1  # the unknown call, made once; the canceled run made no other


def test_a_wait_for_the_run_waits_for_the_watchers_takeover(durable_store_url: str, tmp_path: Path) -> None:
    """Found by the review of this change: a wait for the run right after the request
    (``wait_idle(elsewhere=False)``, what an HTTP write's ``wait`` and a command do) answered at
    once with the stored, undriven run, although this runtime took it over at its next poll and
    drove it to its end."""
    log = CallLog(tmp_path / "calls.jsonl")
    tree_id, effect_id, program = parked_on_an_unknown(durable_store_url, log)
    holder, problems = hold_until_recorded(durable_store_url, tree_id, then_for=0.3)
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0.05) as host:
        host.resolve_unknown_effect(effect_id, Settlement.succeeded({"value": 1}))
        assert not host.owns(tree_id)  # the holder still holds the lease
        tree = host.wait_idle(tree_id, timeout=20, elsewhere=False)
        assert tree.root.status == "completed"
        assert host.drives(tree_id)
        holder.join(30)
        assert not problems, problems
    assert log.count() == 2


def test_an_http_resolve_with_wait_answers_after_the_servers_takeover(tmp_path: Path) -> None:
    """Real ``agentfold serve`` and HTTP client: ``POST /unknown-effects/{id}/resolve`` with
    ``wait`` beside a lease held for a moment answered at once ``driven: false`` with the run
    undriven; the server took it over ~0.2 s later. It now waits for that and says so."""
    from tests.http_api.support import ok as http_ok
    from tests.http_api.support import start_server

    store = sqlite_url(tmp_path)
    doc = {
        "name": "unknown-first",
        "input": {"messages": [{"role": "user", "content": "go"}]},
        "model": {"responses": [{"error": "the model timed out"},
                                {"finish_reason": "stop", "message": {"content": "done"}}]},
    }
    started = run_json(store, write(tmp_path, doc), "--start-id", "passing-http")
    tree_id = TreeID(started["tree_id"])
    [unknown] = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    server = start_server(store, tmp_path)
    try:
        holder, problems = hold_until_recorded(store, tree_id, then_for=0.5)
        with server.client() as c:
            done = http_ok(c.post(f"/unknown-effects/{unknown['effect_id']}/resolve",
                                  json={"model_response": {"finish_reason": "stop", "message": {"content": "ok"}},
                                        "wait": 30}))
        holder.join(30)
        assert not problems, problems
    finally:
        code, _ = server.stop()
    assert code == 0, server.logs()
    # Before: {"driven": false, "idle": true, "tree": {"status": "running", ...}} at once.
    assert (done["driven"], done["idle"], done["tree"]["status"]) == (True, True, "completed"), json.dumps(done)
