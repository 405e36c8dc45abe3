"""Payload nesting is bounded so that every stored form of a payload still encodes.

Found by an app-builder review: payloads nested within the documented 254 levels passed every
check, then their event (the payload inside its body, inside the sealed content) could not be
encoded: a tool returning details 248 levels deep stopped the run's owner
(engine.runtime.failed, the call later recorded `engine.dispatch.interrupted`, the run never
adopted again by a worker), `Runtime.start` with a 252-level input raised a bare TypeError, and
an answer 250 levels deep stopped the owner too. A payload may now nest 128 levels; deeper is
`payload.invalid` naming the path, wherever it comes from, and nothing is stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolOutput
from agentfold.domain.canonical import MAX_DEPTH, normalize
from agentfold.domain.errors import InvalidInput
from tests.test_host_python import Approve


def nest(levels: int) -> Any:
    """Arrays nested ``levels`` deep (the innermost one empty)."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def calls(*tools: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": None,
                        "tool_calls": [{"id": f"c{i}", "name": name, "arguments": "{}"} for i, name in enumerate(tools)]},
            "finish_reason": "tool_calls"}


DONE = {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}


class Deep:
    name = "deep"
    description = "Details nested deep."
    parameters = {"type": "object"}

    def __init__(self, levels: int) -> None:
        self.levels = levels

    def call(self, invocation: Any, arguments: Any) -> ToolOutput:
        return ToolOutput.text("deep", details=nest(self.levels))


def test_normalize_takes_128_levels_and_refuses_129_naming_the_path() -> None:
    assert MAX_DEPTH == 128
    assert normalize({"a": nest(127)}) == {"a": nest(127)}
    with pytest.raises(InvalidInput) as refused:
        normalize({"a": nest(128)})
    assert refused.value.code == "payload.invalid"
    assert "nested deeper than 128 levels (at $.a[0][0]" in refused.value.message
    # Many brackets in text, none nested: accepted (the bracket count only decides whether to look closer).
    assert normalize({"t": "[" * 500, "rows": [[i] for i in range(500)]})["t"] == "[" * 500


def test_a_tool_result_nested_too_deep_is_an_unknown_outcome_saying_so_and_the_owner_drives_on(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'deep.db'}")
    agent = compile_interaction(InteractionConfig(
        name="deep", model=ScriptedModel([calls("deep"), DONE]), tools=[Deep(248)]))
    shallow = compile_interaction(InteractionConfig(
        name="shallow", model=ScriptedModel([calls("deep"), DONE]), tools=[Deep(100)]))
    try:
        with Runtime(store, Catalog([agent, shallow])) as runtime:
            run = runtime.start(agent, {"messages": [{"role": "user", "content": "go"}]}, start_id="deep")
            tree = runtime.wait_idle(run.tree_id, timeout=60)
            assert tree.root.status == "waiting"
            (unknown,) = Host(runtime).unknown("deep")
            assert "nested deeper than 128 levels" in str(unknown["diagnostic"]), unknown
            # The same Runtime goes on driving runs: its owner did not stop.
            other = runtime.start(shallow, {"messages": [{"role": "user", "content": "go"}]}, start_id="shallow")
            assert runtime.result(other.tree_id, timeout=60).status == "completed"
    finally:
        store.close()


def test_host_inputs_nested_too_deep_are_refused_and_append_nothing(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'inputs.db'}")
    agent = compile_interaction(InteractionConfig(name="ask", model=ScriptedModel([calls("approve"), DONE]), tools=[Approve()]))
    try:
        with Runtime(store, Catalog([agent])) as runtime:
            host = Host(runtime)
            with pytest.raises(InvalidInput) as refused:
                runtime.start(agent, {"messages": [{"role": "user", "content": "x"}], "options": {"v": nest(250)}},
                              start_id="too-deep")
            assert refused.value.code == "payload.invalid" and "nested deeper than 128 levels" in refused.value.message
            assert store.tree_ids() == []
            run = runtime.start(agent, {"messages": [{"role": "user", "content": "go"}]}, start_id="run")
            runtime.wait_idle(run.tree_id, timeout=60)
            (pending,) = host.pending("run")
            version = runtime.capture(run.tree_id).version
            with pytest.raises(InvalidInput) as refused:
                host.answer(pending["process_id"], pending["wait_id"], {"ok": nest(250)})
            assert refused.value.code == "payload.invalid" and "nested deeper than 128 levels" in refused.value.message
            assert runtime.capture(run.tree_id).version == version
            host.answer(pending["process_id"], pending["wait_id"], {"ok": nest(10)})
            assert runtime.result(run.tree_id, timeout=60).status == "completed"
    finally:
        store.close()
