"""A tool's input request whose response schema accepts no answer is refused when the tool
raises it (left by an app-builder review: ``response_schema=False`` is valid JSON Schema, and
the wait it opened could only be canceled: every answer was refused)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.program import Program


class Ask:
    name = "ask"
    description = "Asks a human with a schema given by the test."
    parameters = {"type": "object"}

    def __init__(self, schema: Any) -> None:
        self.schema = schema

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            raise ToolInputRequired({"question": "ok?"}, self.schema, None)
        return ToolOutput.text(f"answer: {invocation.continuation.response}")


def agent(schema: Any) -> Program:
    model = ScriptedModel([
        {"message": {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "name": "ask", "arguments": "{}"}]},
         "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"},
    ])
    return compile_interaction(InteractionConfig(name="ask.nothing", model=model, tools=[Ask(schema)]))


@contextmanager
def asked(tmp_path: Path, schema: Any) -> Iterator[tuple[Host, Any]]:
    """A run whose one tool call asks with ``schema``, on a SQLite store, once it is idle."""
    program = agent(schema)
    store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]}, start_id="ask")
            runtime.wait_idle(run.tree_id)
            yield Host(runtime), run
    finally:
        store.close()


@pytest.mark.parametrize("schema", [False, {"not": {}}, {"not": True}, {"enum": []},
                                    {"type": "string", "minLength": 3, "maxLength": 1},
                                    {"anyOf": [False, {"enum": []}]}, {"allOf": [{"type": "object"}, False]}])
def test_a_response_schema_that_accepts_nothing_opens_no_wait(tmp_path: Path, schema: Any) -> None:
    with asked(tmp_path, schema) as (host, run):
        assert host.pending("ask") == []  # no wait only a cancel could end
        [unknown] = host.unknown("ask")
        assert unknown["kind"] == "tool"
        assert "it accepts no answer" in str(unknown["diagnostic"]), unknown["diagnostic"]
        # The host settles the call, and the run goes on.
        host.resolve(unknown["effect_id"], output="nobody could answer")
        assert run.result(timeout=10).status == "completed"


def test_a_response_schema_that_accepts_anything_still_opens_a_wait(tmp_path: Path) -> None:
    with asked(tmp_path, True) as (host, _):
        [pending] = host.pending("ask")
        assert host.unknown("ask") == []
        assert pending["response_schema"] is True, pending


def test_only_schemas_that_plainly_accept_nothing_are_refused() -> None:
    from agentfold.domain.json_schema import accepts_nothing

    for schema in (True, {}, {"type": "string"}, {"not": {"type": "string"}}, {"enum": [1]},
                   {"type": "string", "minLength": 1, "maxLength": 1}, {"minLength": 3, "maxLength": 1},
                   {"anyOf": [False, {"type": "number"}]}):
        assert not accepts_nothing(schema), schema
