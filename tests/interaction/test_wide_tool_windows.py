"""A tool window wider than the default tree limit (16 children of one Process active at once).

An Interaction with ``max_concurrent_tool_calls=20`` whose model asks for 20 calls at once used
to fail its 17th to 20th calls with ``engine.child.tree_limit`` in the middle of the run: the
tree had been started with the default limits. Now a start without limits gets
``max_active_children`` raised to the Program's window (stored in ``TreeStarted``), and limits
the caller gives that allow fewer are refused before anything is stored.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import TreeLimits, TreeStarted
from agentfold.domain.ids import StartID, TreeID
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT, CallLog, ProbeTool, call, chat_input, concurrent_any, final, tool_round
from tests.test_cli import agentfold, ok

WIDTH = 20


def wide_program(log: CallLog, width: int = WIDTH) -> tuple[Any, ScriptedModel]:
    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        time.sleep(0.05)  # the calls overlap
        return ToolOutput.text(f"done:{invocation.call.id}")

    tool = ProbeTool("work", log, behave, concurrency=concurrent_any)
    model = ScriptedModel([tool_round(*[call(f"c{i}", "work") for i in range(width)]), final("all done")])
    config = InteractionConfig(name="test.wide", model=model, tools=[tool], max_concurrent_tool_calls=width)
    return compile_interaction(config), model


def test_a_window_wider_than_the_default_limit_runs_every_call(local_store_url: str) -> None:
    log = CallLog()
    program, model = wide_program(log)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"), start_id="wide-1")
        result = handle.result(WAIT)
        assert result.status == "completed", result
        tree = runtime.capture(handle.tree_id)
    assert log.count() == WIDTH
    results = [m for m in model.requests[1].messages if m["role"] == "tool"][-1]["tool_results"]
    assert [r["id"] for r in results] == [f"c{i}" for i in range(WIDTH)]
    assert all(not r.get("is_error") for r in results), results
    assert tree.limits.max_active_children == WIDTH


def test_limits_that_allow_fewer_children_than_the_window_are_refused_before_anything_is_stored(
    local_store_url: str,
) -> None:
    log = CallLog()
    program, _ = wide_program(log)
    store = EventStore(local_store_url)
    try:
        with open_runtime(store, program) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, chat_input("go"), start_id="wide-2", limits=TreeLimits(max_depth=4))
            assert refused.value.code == "limits.invalid"
            assert "max_active_children is 16" in refused.value.message and "20" in refused.value.message
            assert "TreeLimits(max_active_children=20)" in (refused.value.hint or "")
            assert store.head(TreeID.for_start(StartID("wide-2"))) is None
            # Limits that allow the window are taken as given.
            handle = runtime.start(program, chat_input("go"), start_id="wide-3",
                                   limits=TreeLimits(max_active_children=24))
            assert handle.result(WAIT).status == "completed"
            first = store.read(handle.tree_id, upto=1)[0].event
            assert isinstance(first, TreeStarted) and first.limits.max_active_children == 24
    finally:
        store.close()
    assert log.count() == WIDTH  # only wide-3 ran


def test_a_scenario_with_a_wide_window_completes_from_the_cli(tmp_path: Path) -> None:
    scenario = {
        "name": "wide",
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": f"c{i}", "name": "echo", "arguments": json.dumps({"i": i})} for i in range(WIDTH)]}},
            {"finish_reason": "stop", "message": {"content": "done"}},
        ]},
        "tools": [{"name": "echo", "description": "echo", "result": {"output": {"content": "ok"}},
                   "concurrency": {"key": "", "concurrent": True}}],
        "limits": {"max_concurrent_tool_calls": WIDTH},
    }
    path = tmp_path / "wide.json"
    path.write_text(json.dumps(scenario))
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    ran = ok(agentfold("run", str(path), "--start-id", "wide", "--json", store=store))
    assert json.loads(ran.stdout)["status"] == "completed", ran.stdout
    shown = json.loads(ok(agentfold("show", "wide", "--json", store=store)).stdout)
    assert shown["limits"]["max_active_children"] == WIDTH
    calls = [p for p in shown["processes"] if p["parent_id"] is not None]
    assert len(calls) == WIDTH
    assert [(p["status"], (p["output"] or {}).get("disposition")) for p in calls] == [("completed", "succeeded")] * WIDTH


def test_an_interaction_without_tools_needs_no_active_children(local_store_url: str) -> None:
    # Found by a review: a tool-less Interaction was refused under max_active_children=0
    # ("runs up to 1 children at once"), though it starts no child.
    model = ScriptedModel([final("hello")])
    program = compile_interaction(InteractionConfig(name="test.toolless", model=model))
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("hi"), limits=TreeLimits(max_active_children=0))
        assert handle.result(WAIT).status == "completed"
