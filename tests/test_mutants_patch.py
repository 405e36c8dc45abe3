"""What the mutation audit of child inputs stored as changes (``input_patch``,
agentfold/domain/input_changes.py) and of the transform Program (agentfold/domain/workflow.py)
found untested.

The kernel checks that the ops it writes rebuild the input exactly and stores the input whole
otherwise: that check hid every bug in dropping, cutting or number handling from the existing
tests (the input was then merely stored whole), while a history written by a correct release
holding such ops would have been rebuilt wrong by the same fold. Here: each kind of op is
written for a sibling input that needs it and rebuilds exactly what the child got, through
``show --json`` after an export and an import; the ops mean what docs/events.md says; the
rebuilt input lists its members in key order (as a stored input decodes); a forged op (a
boolean index, a member too many) is refused; a tool payload that merely looks like a start
with changes is the tool's; a transcript rebuilds a start from its own Program's last input.
For a transform: a host's outcome with a member beside ``output`` is refused, and a failed
outcome without an error text fails the run with the documented text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import TOPIC_PREFIX, stored_json
from agentfold.adapters.dispatch import FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.events import event_version
from agentfold.domain.input_changes import apply_changes
from agentfold.domain.program import Complete, Continue, Descriptor, Program, Step, dispatcher_effect
from agentfold.domain.requests import Settlement
from tests.interaction.test_resolution_checked import _parked, _refused, running, transform_program
from tests.kernel_programs import IMPL, JsonStrategy, config_digest
from tests.test_cli import agentfold, ok
from tests.test_fold_rules import assert_corrupt
from tests.test_input_stored_once import _StartsTwo, _team_events, _with_payload


class _Echo(JsonStrategy):
    """Completes with the input it was started with."""

    def decide(self, state: Any, window: Any) -> Step:
        return Step(0, Complete(state["input"]), {"phase": "done"})


def _parent(name: str, first: Any, second: Any) -> Program:
    """Starts child ``a`` with ``first``, then ``b`` with ``second`` named ``input_like="a"``;
    completes with what each child got."""
    child = Program(Descriptor(f"{name}.child", input_schema={"type": "object"}), _Echo(), IMPL,
                    config_digest(f"{name}.child"))
    return Program(Descriptor(name, input_schema={"type": "object"}), _StartsTwo("a", child, first, second), IMPL,
                   config_digest(name), children=(child,))


def _run_two(url: str, name: str, first: Any, second: Any) -> tuple[Any, Any, Any]:
    """(tree id, the run's output, the live tree) of ``_parent`` run on ``url``."""
    parent = _parent(name, first, second)
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, {}, start_id=name)
            result = handle.result(timeout=30)
            live = runtime.capture(handle.tree_id)
        assert result.status == "completed", result
        return handle.tree_id, result.output, live
    finally:
        store.close()


def _declared_payloads(url: str, tree_id: Any) -> list[dict[str, Any]]:
    store = EventStore(url)
    try:
        return [orjson.loads(stored_json(s.state))["event"]["payload"] for s in store.read_raw(tree_id)
                if "EffectDeclared" in s.topic]
    finally:
        store.close()


def _exact(value: Any) -> bytes:
    """Canonical JSON: 1, 1.0 and true differ here (they are equal in Python)."""
    return canonical_bytes(value)


FIRST = {
    "count": 1, "flag": 1, "ratio": 1, "label": "café",
    "gone": "g" * 40,
    "items": ["i" * 120, "j" * 120, "k" * 120, "l" * 120],
    "nested": {"keep": "n" * 200, "old": 1, "list": [1, 2, 3]},
}
# Every kind of op: members dropped (top level and nested), arrays cut (and then changed),
# 1 becoming 1.0 and true, a string changed only in its unicode normalization, a member added.
SECOND = {
    "count": 1.0, "flag": True, "ratio": 1, "label": "cafe\u0301",
    "items": ["i" * 120, "changed"],
    "nested": {"keep": "n" * 200, "list": [1, 2], "ünï": "new"},  # one item cut
}


def test_a_sibling_input_with_members_dropped_arrays_cut_and_numbers_retyped_is_stored_as_changes_and_rebuilt_exactly(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'two.db'}"
    tree_id, output, _ = _run_two(url, "patch.kinds", FIRST, SECOND)
    # Each child got exactly its input (1, 1.0 and true kept apart).
    assert sorted(_exact(o) for o in output) == sorted([_exact(FIRST), _exact(SECOND)])

    # Stored as changes, with each kind of op: drop, cut and set.
    declared = _declared_payloads(url, tree_id)
    patch = declared[1].get("input_patch")
    assert patch is not None and "input" not in declared[1], declared[1]
    assert patch["base"] == "a"
    assert {op["op"] for op in patch["ops"]} == {"set", "drop", "cut"}, patch["ops"]

    # An export read into another store: `show --json` prints child b's input exactly, and the
    # audit finds the imported history sound.
    exported = tmp_path / "tree.jsonl"
    ok(agentfold("export", str(tree_id), "--out", str(exported), store=url))
    other = f"sqlite:///{tmp_path / 'imported.db'}"
    ok(agentfold("import", str(exported), store=other))
    shown = json.loads(ok(agentfold("show", str(tree_id), "--json", store=other)).stdout)
    inputs = {p["child_key"]: p["input"] for p in shown["processes"] if p["child_key"]}
    assert (_exact(inputs["a"]), _exact(inputs["b"])) == (_exact(FIRST), _exact(SECOND))
    ok(agentfold("audit", "verify", "--all", store=other))


def test_the_documented_ops_rebuild_the_documented_input() -> None:
    """docs/events.md: what each op means (a feed consumer applies them as written; an old
    history written by a correct release holds them whatever this release would write)."""
    base = {"a": 1, "list": [1, 2, 3], "obj": {"x": 1, "y": [True, None]}}
    cases = [
        ([{"op": "set", "path": ["a"], "value": 2}], {"a": 2, "list": [1, 2, 3], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "set", "path": ["b"], "value": [1]}],
         {"a": 1, "b": [1], "list": [1, 2, 3], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "set", "path": ["list", 3], "value": 4}], {"a": 1, "list": [1, 2, 3, 4], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "set", "path": ["list", 0], "value": 0}], {"a": 1, "list": [0, 2, 3], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "drop", "path": ["a"]}], {"list": [1, 2, 3], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "drop", "path": ["obj", "x"]}], {"a": 1, "list": [1, 2, 3], "obj": {"y": [True, None]}}),
        ([{"op": "cut", "path": ["list"], "length": 1}], {"a": 1, "list": [1], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "cut", "path": ["obj", "y"], "length": 0}], {"a": 1, "list": [1, 2, 3], "obj": {"x": 1, "y": []}}),
        ([{"op": "cut", "path": ["list"], "length": 1}, {"op": "set", "path": ["list", 1], "value": 9}],
         {"a": 1, "list": [1, 9], "obj": {"x": 1, "y": [True, None]}}),
        ([{"op": "set", "path": ["obj", "y", 1], "value": 1.0}], {"a": 1, "list": [1, 2, 3], "obj": {"x": 1, "y": [True, 1.0]}}),
        ([{"op": "set", "path": [], "value": "whole"}], "whole"),
    ]
    for ops, expected in cases:
        before = _exact(base)
        assert _exact(apply_changes(base, ops)) == _exact(expected), ops
        assert _exact(base) == before, ops  # the base child's input is not changed


def test_a_rebuilt_input_lists_its_members_in_key_order_as_a_stored_input_decodes(tmp_path: Path) -> None:
    """docs/events.md: "The rebuilt input is in canonical form (object members in key order),
    as a stored input decodes": a Python host reading a child's input (``capture``, ``load``)
    sees the same member order whether its start stored it whole or as changes."""
    first = {"m": "x" * 300, "z": 1, "nested": {"k": "y" * 100, "q": 1}}
    second = {"m": "x" * 300, "z": 1, "aa": 2, "é": 3, "A": 4, "nested": {"k": "y" * 100, "q": 1, "c": 5}}
    url = f"sqlite:///{tmp_path / 'order.db'}"
    tree_id, _, live = _run_two(url, "patch.order", first, second)
    assert "input_patch" in _declared_payloads(url, tree_id)[1]
    store = EventStore(url)
    try:
        trees = {"live": live, "folded": store.load(tree_id, use_snapshot=False).state, "snapshot": store.load(tree_id).state}
    finally:
        store.close()
    for how, tree in trees.items():
        inputs = {str(p.child_key): p.input for p in tree.processes.values() if p.child_key}
        # orjson keeps a dict's member order; canonical_bytes sorts: equal only in key order.
        assert orjson.dumps(inputs["b"]) == canonical_bytes(second), (how, list(inputs["b"]))
        assert orjson.dumps(inputs["a"]) == canonical_bytes(first), how


@pytest.mark.parametrize("op", [
    # JSON true is no array index (it would be read as index 1).
    {"op": "set", "path": ["tasks", True, "request"], "value": {}},
    # An op has exactly its members: a drop carrying a value is no drop.
    {"op": "drop", "path": ["tasks", 0, "request"], "value": {}},
], ids=["boolean-index", "drop-with-a-value"])
def test_a_stored_change_that_is_no_documented_op_is_refused(op: dict[str, Any]) -> None:
    """A forged history with such an op is refused (effect.input_patch), not read some way."""
    events, patched = _team_events()
    index = patched[-1]

    def forge(payload: dict[str, Any]) -> None:
        payload["input_patch"]["ops"].append(op)

    bad_events, bad = _with_payload(events, index, forge)
    assert event_version(bad) == 2
    assert_corrupt(bad_events, bad, "effect.input_patch")


# A tool call's own payload, which happens to use the names of a framework start.
LOOKALIKE = {"operation": "start_child", "key": "report", "input_patch": {"base": "draft", "ops": []}}


class _CallsWithStartNames(JsonStrategy):
    def decide(self, state: Any, window: Any) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue((dispatcher_effect(LOOKALIKE),)), {"phase": "calling"})
        return Step(1, Complete(window[0].payload), {"phase": "done"})


def test_a_dispatcher_call_whose_payload_looks_like_a_start_with_changes_is_stored_and_read_as_written(
        tmp_path: Path) -> None:
    """Only a framework start holds a child input as changes: a tool's payload that happens to
    have ``operation: start_child`` and ``input_patch`` is the tool's, passed on as written,
    stored at schema version 1, and its tree loads and audits sound (it was refused:
    ``effect.input_patch``, a tree that no longer loads)."""
    program = Program(Descriptor("patch.lookalike", input_schema={"type": "object"}), _CallsWithStartNames(), IMPL,
                      config_digest("patch.lookalike"),
                      dispatcher=FunctionDispatcher(lambda request, context: Settlement.succeeded({"got": request.payload})))
    url = f"sqlite:///{tmp_path / 'lookalike.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="lookalike")
            result = handle.result(timeout=30)
        assert (result.status, result.output) == ("completed", {"got": LOOKALIKE}), result
        topics = [s.topic for s in store.read_raw(handle.tree_id)]
        assert TOPIC_PREFIX + "EffectDeclared" in topics and TOPIC_PREFIX + "EffectDeclared@2" not in topics
    finally:
        store.close()
    reopened = EventStore(url)
    try:
        tree = reopened.load(handle.tree_id, use_snapshot=False).state
        assert tree.root.terminal and tree.root.output == {"got": LOOKALIKE}
    finally:
        reopened.close()
    ok(agentfold("audit", "verify", "--all", store=url))


def test_a_transform_outcome_with_a_member_beside_its_output_is_refused(tmp_path: Path) -> None:
    """A transform's outcome is exactly ``{"output": ...}`` (what its function returned):
    anything more is refused before anything is recorded."""
    program = transform_program()
    with running(tmp_path, program, "extra.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)
        _refused(runtime, store, handle, effect, Settlement.succeeded({"output": 40, "note": "checked by hand"}),
                 "engine.effect.settlement_invalid", 'a transform\'s outcome is {"output": ...}')
        runtime.resolve_unknown_effect(effect, Settlement.succeeded({"output": 40}))
        result = runtime.result(handle.tree_id, timeout=30)
        assert (result.status, result.output) == ("completed", 40)


@pytest.mark.parametrize("payload", [{}, {"error": {"code": 503}}])
def test_a_failed_transform_outcome_without_an_error_text_fails_the_run_with_the_documented_text(
        tmp_path: Path, payload: Any) -> None:
    program = transform_program()
    with running(tmp_path, program, "failed.db") as (runtime, _store):
        handle, effect = _parked(runtime, program, 20)
        runtime.resolve_unknown_effect(effect, Settlement.failed(payload))
        result = runtime.result(handle.tree_id, timeout=30)
    assert result.status == "failed"
    assert result.termination is not None
    failure = result.termination["failure"]
    assert (failure["code"], failure["message"]) == ("transform.failed", "the transform failed")


class _StartsChats(JsonStrategy):
    """Starts ``x1`` (Program ``x``), ``y1`` then ``y2`` (Program ``y``, ``input_like`` ``y1``),
    one per Step; then waits for all three and completes."""

    def __init__(self, x: Program, y: Program, inputs: dict[str, Any]) -> None:
        self.x, self.y, self.inputs = x, y, inputs

    def decide(self, state: Any, window: Any) -> Step:
        from agentfold.domain.ids import ChildKey, ProcessID, WaitKey
        from agentfold.domain.program import ChildSpec, ChildWaitSpec, Wait, start_child_effect, wait_children_effect

        phase = state.get("phase", "start")
        started = [*state.get("started", []), *[s.payload["process_id"] for s in window if phase in ("x1", "y1", "y2")]]
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("x1"), self.x.ref, self.inputs["x1"])),)),
                        {"phase": "x1"})
        if phase == "x1":
            return Step(1, Continue((start_child_effect(ChildSpec(ChildKey("y1"), self.y.ref, self.inputs["y1"])),)),
                        {"phase": "y1", "started": started})
        if phase == "y1":
            spec = ChildSpec(ChildKey("y2"), self.y.ref, self.inputs["y2"])
            return Step(1, Continue((start_child_effect(spec, input_like="y1"),)), {"phase": "y2", "started": started})
        if phase == "y2":
            spec_all = ChildWaitSpec(WaitKey("all"), tuple(ProcessID(p) for p in started))
            return Step(1, Continue((wait_children_effect(spec_all),)), {"phase": "opening", "started": started})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})
        return Step(1, Complete(None), {"phase": "done"})


def test_a_transcript_rebuilds_a_start_stored_as_changes_from_its_own_programs_last_input(tmp_path: Path) -> None:
    """A parent that starts Interactions of two Programs: the transcript of ``y2`` (stored as
    changes from ``y1``) shows ``y2``'s input messages, not ``y1``'s changes applied to the
    last input of the other Program, nor nothing where a change touches a member it does not show."""
    from agentfold.adapters.feed import envelope_of
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.models import ScriptedModel
    from agentfold.projections.transcripts import TreeTranscripts, check_envelope

    answer = {"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    x = compile_interaction(InteractionConfig(name="patch.chat.x", model=ScriptedModel([answer])))
    y = compile_interaction(InteractionConfig(name="patch.chat.y", model=ScriptedModel([answer, answer])))
    history = [{"role": "user", "content": "tell me " * 60}, {"role": "assistant", "content": "sure " * 60}]
    inputs = {
        "x1": {"messages": [{"role": "user", "content": "another question"}, {"role": "assistant", "content": "hm"}]},
        # Members a transcript does not show, changed too (it keeps only what it shows).
        "y1": {"messages": history[:1], "options": {"temperature": 0.2, "seed": 1}},
        "y2": {"messages": [*history, {"role": "user", "content": "and then?"}], "options": {"temperature": 0.5}},
    }
    parent = Program(Descriptor("patch.chats", input_schema={"type": "object"}), _StartsChats(x, y, inputs),
                     IMPL, config_digest("patch.chats"), children=(x, y))
    store = EventStore(f"sqlite:///{tmp_path / 'chats.db'}")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, {}, start_id="chats")
            assert handle.result(timeout=30).status == "completed"
            tree = runtime.capture(handle.tree_id)
        declared = [orjson.loads(stored_json(s.state))["event"]["payload"] for s in store.read_raw(handle.tree_id)
                    if "EffectDeclared" in s.topic]
        y2_start = next(p for p in declared if p.get("key") == "y2")
        assert y2_start.get("input_patch", {}).get("base") == "y1", y2_start  # stored as changes
        builder = TreeTranscripts(str(handle.tree_id))
        entries: list[dict[str, Any]] = []
        for n in store.recorder.select_notifications(start=1, limit=1000):
            entries.extend(builder.apply(check_envelope(envelope_of(n))) or [])
    finally:
        store.close()
    keys = {str(p.process_id): str(p.child_key) for p in tree.processes.values() if p.child_key}
    shown: dict[str, list[str]] = {}
    for e in entries:
        if e["kind"] == "input_message":
            shown.setdefault(keys[e["process_id"]], []).append(e["text"])
    assert shown == {key: [m["content"] for m in value["messages"]] for key, value in inputs.items()}
