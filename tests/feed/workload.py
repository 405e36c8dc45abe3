"""Runs for the feed tests and the feed benchmark: real Interactions on a real store.

Three scenario shapes, cycled, so a batch of runs covers every transcript entry kind:

* ``trip``: a two-call tool round, a tool that asks a human (input wait), a steering
  message sent while the wait is open, the answer, and a final answer;
* ``delegate``: a call to a tool that is not bound (rejected in the Interaction), a
  Delegate (a nested Interaction), a tool that fails definitely, then a final answer;
* ``unknown``: a tool whose outcome is unknown, a steering message, a host resolution,
  then a final answer.

Two more shapes run by name only: ``model_unknown`` (a model call's outcome is unknown;
a host gives the response) and ``failing`` (the Interaction fails).

Runs are driven in-process by one :class:`Runtime` with scripted models, so hundreds of
runs take seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import steer_signal
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_catalog, scenario_program, validate_scenario
from agentfold.domain.ids import EffectID, ProcessID, TreeID
from agentfold.domain.interaction.settle import settle_model_result, settle_tool_result
from agentfold.domain.program import Program
from agentfold.domain.requests import effect_request
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import pending_tool_inputs, unknown_effects

SHAPES = ("trip", "delegate", "unknown")


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": arguments}


def _final(text: str) -> dict[str, Any]:
    return {"finish_reason": "stop", "message": {"content": text}}


TRIP: dict[str, Any] = {
    "name": "feed-trip",
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "Checking weather and booking.", "tool_calls": [
            _call("call_weather", "weather", '{"city": "Lisbon"}'),
            _call("call_hotel", "book_hotel", '{"city": "Lisbon", "nights": 3}'),
        ]}, "usage": {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160}},
        {"finish_reason": "tool_calls", "message": {"content": "I need your approval.", "tool_calls": [
            _call("call_budget", "approve_budget", '{"amount_eur": 420}'),
        ]}},
        _final("Trip planned: Hotel Alfama, sunny, budget approved, window seat noted."),
    ]},
    "tools": [
        {"name": "weather", "parameters": {"type": "object", "required": ["city"]}, "result": {"output": "sunny, 24 C"}},
        {"name": "book_hotel", "parameters": {"type": "object"},
         "result": {"output": {"hotel": "Hotel Alfama", "confirmation": "H-1042"}}},
        {"name": "approve_budget", "parameters": {"type": "object"},
         "result": {"input": {"prompt": {"question": "Approve 420 EUR?"},
                              "response_schema": {"type": "object", "required": ["approved"],
                                                  "properties": {"approved": {"type": "boolean"}}}},
                    "then": {"answer": True}}},
    ],
}

DELEGATE: dict[str, Any] = {
    "name": "feed-delegate",
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "Let me research.", "tool_calls": [
            _call("call_missing", "teleport", "{}"),
            _call("call_writer", "writer", '{"topic": "Lisbon"}'),
            _call("call_lookup", "lookup", '{"q": "tram 28"}'),
        ]}},
        _final("Here is the summary the writer produced."),
    ]},
    "tools": [
        {"name": "lookup", "parameters": {"type": "object"},
         "result": {"failure": {"kind": "failed", "output": "lookup service is down"}}},
    ],
    "delegates": [
        {"name": "writer", "description": "writes a summary",
         "input_schema": {"type": "object", "required": ["topic"], "properties": {"topic": {"type": "string"}}},
         "scenario": {"name": "feed-writer", "model": {"responses": [_final("Lisbon: hills, trams, pastel de nata.")]}}},
    ],
}

UNKNOWN: dict[str, Any] = {
    "name": "feed-unknown",
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "Charging the card.", "tool_calls": [
            _call("call_charge", "charge", '{"amount_eur": 99}'),
        ]}},
        _final("The card was charged; I also took your note into account."),
    ]},
    "tools": [
        {"name": "charge", "parameters": {"type": "object"}, "result": {"error": "gateway timed out"}},
    ],
}

# Not in the cycle; run by name: a model call whose outcome is unknown (a host gives the
# response), and an Interaction that fails (tool calls with a non-tool finish reason).
MODEL_UNKNOWN: dict[str, Any] = {"name": "feed-model-unknown", "model": {"responses": [{"error": "model overloaded"}]}}
FAILING: dict[str, Any] = {
    "name": "feed-failing",
    "model": {"responses": [
        {"finish_reason": "content_filter", "message": {"content": "Filtered.", "tool_calls": [_call("call_x", "weather", "{}")]}},
    ]},
    "tools": [{"name": "weather", "result": {"output": "sunny"}}],
}

DOCS = {"trip": TRIP, "delegate": DELEGATE, "unknown": UNKNOWN, "model_unknown": MODEL_UNKNOWN, "failing": FAILING}
EXPECTED_STATUS = {"failing": "failed"}


@dataclass(frozen=True, slots=True)
class Run:
    shape: str
    tree_id: TreeID
    root_process_id: str


class Workload:
    """Starts and finishes runs of the three shapes on one store."""

    def __init__(self, store: EventStore, *, runtime: Runtime | None = None) -> None:
        self.store = store
        self.programs: dict[str, Program] = {shape: scenario_program(validate_scenario(doc)) for shape, doc in DOCS.items()}
        self.docs = {shape: validate_scenario(doc) for shape, doc in DOCS.items()}
        self.runtime = runtime or Runtime(store, scenario_catalog(*self.programs.values()), poll_interval=0)
        self._own_runtime = runtime is None

    def close(self) -> None:
        if self._own_runtime:
            self.runtime.close()

    def run(self, index: int, shape: str | None = None) -> Run:
        """One complete run (terminal when this returns)."""
        shape = shape or SHAPES[index % len(SHAPES)]
        program, doc = self.programs[shape], self.docs[shape]
        user = {"role": "user", "content": f"request {index}: {shape}"}
        handle = self.runtime.start(
            program, {"messages": [{"role": "system", "content": "You are a planner."}, user]},
            start_id=f"feed-run-{index}-{shape}-{time.monotonic_ns()}", configuration=doc,
        )
        tree = self.runtime.wait_idle(handle.tree_id, 30)
        root = tree.root.process_id
        if shape == "trip":
            self._steer(root, index)
            tree = self.runtime.wait_idle(handle.tree_id, 30)
            (pending,) = pending_tool_inputs(tree)
            self.runtime.deliver_signals(pending.process_id, [pending.response_signal(f"answer-{index}", {"approved": True})])
        elif shape == "unknown":
            self._steer(root, index)
            tree = self.runtime.wait_idle(handle.tree_id, 30)
            self._resolve(tree)
        elif shape == "model_unknown":
            self._resolve(tree)
        tree = self.runtime.wait_idle(handle.tree_id, 30)
        if tree.root.status != EXPECTED_STATUS.get(shape, "completed"):
            raise AssertionError(f"run {index} ({shape}) ended {tree.root.status}: {tree.root.termination}")
        return Run(shape, handle.tree_id, str(root))

    def _steer(self, root: ProcessID, index: int) -> None:
        signal = steer_signal(f"steer-{index}", {"role": "user", "content": f"note {index}: window seat please"})
        self.runtime.deliver_signals(root, [signal])

    def _resolve(self, tree: TreeState) -> None:
        (unknown,) = unknown_effects(tree, self.runtime.catalog.resolve)
        process = tree.processes[ProcessID(unknown["process_id"])]
        program = self.runtime.catalog.resolve(process.program)
        assert program is not None
        request = effect_request(tree, process.process_id, EffectID(unknown["effect_id"]), program)
        if unknown["kind"] == "model":
            settlement = settle_model_result(
                program, request, {"finish_reason": "stop", "message": {"role": "assistant", "content": "Recovered answer."}}
            )
        else:
            settlement = settle_tool_result(program, request, {"details": {"charged": True, "reference": "C-7"}})
        self.runtime.resolve_unknown_effect(unknown["effect_id"], settlement, process_id=process.process_id)

    def runs(self, count: int, on_run: Callable[[Run], None] | None = None) -> list[Run]:
        out = []
        for index in range(count):
            run = self.run(index)
            out.append(run)
            if on_run is not None:
                on_run(run)
        return out
