"""Smoke tests of the runtime on every store backend."""

from __future__ import annotations

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import CallLog, asker_program, chain_program, logged_call, parent_program


def test_chain_of_dispatcher_effects_completes_with_one_append_per_effect(store_url: str, tmp_path) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    program = chain_program(logged_call(log, 2))
    store = EventStore(store_url)
    with Runtime(store) as runtime:
        handle = runtime.start(program, {"n": 5})
        result = handle.result(timeout=30)
        assert result.status == "completed"
        assert result.output == {"total": 10, "effects": 5}
        assert log.count() == 5
        assert runtime.appends == 6  # the start, then one append per effect


def test_children_answer_their_waits_and_the_parent_collects_outputs(store_url: str) -> None:
    child = asker_program()
    parent = parent_program(child, 2)
    store = EventStore(store_url)
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, None)
        tree = runtime.wait_idle(handle.tree_id)
        children = [p for p in tree.processes.values() if p.parent_id]
        assert [c.status for c in children] == ["waiting", "waiting"]
    with Runtime(store, Catalog([parent])) as runtime:
        for i, child_state in enumerate(children):
            accepted = runtime.deliver_signals(
                child_state.process_id,
                [SignalRequest(SignalID(f"answer-{i}"), {"name": f"n{i}"}, child_state.current_wait)],
            )
            assert accepted
        result = runtime.result(handle.tree_id, timeout=30)
    assert result.status == "completed"
    assert result.output == {"outcomes": [{"status": "completed", "output": {"hello": "n0"}},
                                          {"status": "completed", "output": {"hello": "n1"}}]}
