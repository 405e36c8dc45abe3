"""A completion whose output is a settled result is stored once (ProcessTerminated ``output_of``).

What a user observes: the bytes of a tool's output appear once in the stored history (in
its settlement), while the folded state, ``show``, the read models, replays and the Kafka
transcripts still give the Tool child's output; a hint that does not hold stores the output
inline; a stream whose reference does not hold is refused with ``terminal.output_of``; a
topic whose schema version does not match its body is refused with ``stream.schema_version``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import TOPIC_PREFIX, DecodeError, PydanticMapper, stored_json
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import envelope_of
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolOutput
from agentfold.domain.events import OutputRef, ProcessTerminated, event_body, event_version
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import chain_digest, content_bytes, seal
from agentfold.domain.program import Complete, Continue, Descriptor, OutputOf, Program, Signal, Step, dispatcher_effect
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.tree import fold_tree
from agentfold.projections.transcripts import SchemaVersionUnsupported, TreeTranscripts, check_envelope
from tests.kernel_programs import IMPL, JsonStrategy, config_digest
from tests.test_fold_rules import assert_corrupt, eid, one_effect, settled, step, terminated

TOOL_TEXT = "stored-once:" + "the quick brown fox jumps over the lazy dog; " * 40


def _stores(tmp_path: Path) -> list[str]:
    return ["memory:", f"sqlite:///{tmp_path / 'once.db'}"]


class Fetch:
    name = "fetch"
    description = "Returns a long, recognizable text."
    parameters = {"type": "object", "properties": {}}

    def call(self, invocation: Any, arguments: Any) -> Any:
        return ToolOutput.text(TOOL_TEXT)


def _interaction() -> Program:
    model = ScriptedModel([
        {"message": {"role": "assistant", "tool_calls": [{"id": "c1", "name": "fetch", "arguments": "{}"}]},
         "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"},
    ])
    return compile_interaction(InteractionConfig(name="test.once", model=model, tools=[Fetch()]))


def run_interaction(store: EventStore, start_id: str) -> tuple[TreeID, Catalog]:
    """Run the one-tool-round Interaction to completion on ``store``; its tree and Programs."""
    program = _interaction()
    catalog = Catalog([program])
    runtime = Runtime(store, catalog)
    try:
        handle = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]}, start_id=start_id)
        assert handle.result(timeout=60).status == "completed"
        runtime.wait_idle(handle.tree_id)
    finally:
        runtime.close()
    return handle.tree_id, catalog


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_tool_output_is_stored_once_and_every_reader_still_sees_it(tmp_path: Path, kind: str) -> None:
    url = "memory:" if kind == "memory" else f"sqlite:///{tmp_path / 'once.db'}"
    store = EventStore(url)
    tree_id, catalog = run_interaction(store, "once-1")
    raw = store.read_raw(tree_id)
    needle = TOOL_TEXT.encode()
    holders = [s.topic for s in raw if needle in stored_json(s.state)]
    assert holders == [TOPIC_PREFIX + "EffectSettled"], holders  # once, in the tool's settlement

    terminated_topics = [s.topic for s in raw if s.topic.startswith(TOPIC_PREFIX + "ProcessTerminated")]
    assert TOPIC_PREFIX + "ProcessTerminated@2" in terminated_topics  # the Tool child refers to it

    # The fold (show, read models, replay) gives the Tool child its output.
    tree = store.load(tree_id, catalog.resolve).state
    tool = next(p for p in tree.processes.values() if p.parent_id is not None)
    assert tool.output["disposition"] == "succeeded"
    assert tool.output["output"]["content"][0]["text"] == TOOL_TEXT

    # The Kafka envelopes carry the stored bodies; the transcript builder resolves the reference.
    if kind == "sqlite":
        builder = TreeTranscripts(str(tree_id))
        entries: list[dict[str, Any]] = []
        for n in store.recorder.select_notifications(start=1, limit=1000):
            envelope = check_envelope(envelope_of(n))
            if envelope["type"] == "ProcessTerminated" and "output_of" in envelope["payload"]:
                assert envelope["schema_version"] == 2 and "output" not in envelope["payload"]
            entries.extend(builder.apply(envelope) or [])
        results = [e for e in entries if e["kind"] == "tool_result"]
        assert [r["text"] for r in results] == [TOOL_TEXT]
        # The builder's state survives a restart in the middle (it is JSON).
        assert orjson.loads(orjson.dumps(builder.to_json()))["settled"] == {}


class _Completes(JsonStrategy):
    """One dispatcher effect, then Complete with a chosen output and an ``output_of`` hint."""

    def __init__(self, output: Any, path: Sequence[str]) -> None:
        self.output, self.path = output, tuple(path)

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if not window:
            return Step(0, Continue((dispatcher_effect({"go": 1}),)), {"phase": "called"})
        signal = window[0]
        assert signal.effect_id is not None
        return Step(1, Complete(self.output, OutputOf(signal.effect_id, self.path)), {"phase": "done"})


def _completing(output: Any, path: Sequence[str], name: str) -> Program:
    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        return Settlement.succeeded({"result": {"answer": 42}})

    schema = {"type": "object"}
    return Program(
        Descriptor(name, input_schema=schema), _Completes(output, path), IMPL, config_digest(name),
        dispatcher=FunctionDispatcher(call),
    )


@pytest.mark.parametrize(
    ("output", "path", "stored_as"),
    [
        ({"answer": 42}, ["result"], "reference"),
        ({"answer": 41}, ["result"], "inline"),  # the hint does not hold: stored inline
        ({"answer": 42}, ["nowhere"], "inline"),
    ],
)
def test_the_kernel_stores_a_reference_only_when_the_hint_holds(output: Any, path: list[str], stored_as: str) -> None:
    program = _completing(output, path, f"test.once.{stored_as}.{path[0]}.{output['answer']}")
    store = EventStore("memory:")
    runtime = Runtime(store, Catalog([program]))
    try:
        handle = runtime.start(program, {}, start_id="hint")
        result = handle.result(timeout=30)
    finally:
        runtime.close()
    assert result.status == "completed" and result.output == output
    last = store.read_raw(handle.tree_id)[-1]
    body = orjson.loads(stored_json(last.state))["event"]
    if stored_as == "reference":
        assert last.topic == TOPIC_PREFIX + "ProcessTerminated@2"
        assert body["output_of"] == {"effect_id": str(eid(1, 0, handle.root_process_id)), "path": path}
        assert "output" not in body
    else:
        assert last.topic == TOPIC_PREFIX + "ProcessTerminated"
        assert body["output"] == output and "output_of" not in body
    assert store.load(handle.tree_id).state.processes[handle.root_process_id].output == output


# -- the fold rule ------------------------------------------------------------------------------


def _by_ref(ref: OutputRef, output: Any = None) -> ProcessTerminated:
    return terminated(output={"x": 1}).model_copy(update={"output": output, "output_of": ref})


def test_a_reference_to_a_consumed_settlement_folds_to_its_value() -> None:
    events = [*one_effect()[:-1], _by_ref(OutputRef(effect_id=eid(1), path=("value",)))]
    tree = fold_tree(events)
    assert tree.root.output == 1  # settled(1) carries {"value": 1}
    whole = [*one_effect()[:-1], _by_ref(OutputRef(effect_id=eid(1)))]
    assert fold_tree(whole).root.output == {"value": 1}


@pytest.mark.parametrize(
    "case",
    ["unknown-effect", "missing-path", "inline-too", "failed-settlement"],
)
def test_terminal_output_of_a_reference_that_does_not_hold_is_refused(case: str) -> None:
    events = one_effect()[:-1]
    ref = OutputRef(effect_id=eid(1), path=("value",))
    if case == "unknown-effect":
        bad = _by_ref(OutputRef(effect_id=eid(7)))
    elif case == "missing-path":
        bad = _by_ref(OutputRef(effect_id=eid(1), path=("value", "deeper")))
    elif case == "inline-too":
        bad = _by_ref(ref, output={"value": 1})
    else:
        events[4] = settled(1, status="failed", payload={"error": "no"})
        bad = _by_ref(ref)
    events.append(bad)
    assert_corrupt(events, bad, "terminal.output_of")


def test_a_reference_is_only_valid_right_after_the_complete_step_that_consumed_it() -> None:
    # A later Step's completion cannot point back at a settlement an earlier Step consumed.
    events = [
        *one_effect()[:5],
        step(2, "checkpoint", consumed=1),
    ]
    from agentfold.domain.events import CheckpointCommitted

    events.append(CheckpointCommitted(process_id=events[0].process_id, step=2, kind="test.mark", acknowledges=None))
    events.append(step(3, "complete"))
    bad = _by_ref(OutputRef(effect_id=eid(1), path=("value",)))
    events.append(bad)
    assert_corrupt(events, bad, "terminal.output_of")


# -- the topic's schema version must match the body ---------------------------------------------


def _stored(event: ProcessTerminated, tag: str, position: int = 7) -> StoredEvent:
    tree_id = "tree:00000000000000000000000000000001"
    content = content_bytes(event_body(event), "2026-01-01T00:00:00.000000Z")
    digest = chain_digest(None, tree_id, position, tag, content)
    import uuid

    return StoredEvent(uuid.UUID(int=1), position, TOPIC_PREFIX + tag, seal(content, digest))


@pytest.mark.parametrize(
    ("event", "tag"),
    [
        (_by_ref(OutputRef(effect_id=eid(1))), "ProcessTerminated"),  # a v2 body under a v1 topic
        (terminated(), "ProcessTerminated@2"),  # a v1 body under a v2 topic
        (terminated(), "ProcessTerminated@3"),  # a version this code does not know
        (terminated(), "ProcessTerminated@02"),
    ],
)
def test_a_topic_whose_schema_version_does_not_fit_its_body_is_refused(event: ProcessTerminated, tag: str) -> None:
    mapper = PydanticMapper(transcoder=None)  # type: ignore[arg-type]
    with pytest.raises(DecodeError) as caught:
        mapper.decode("tree:00000000000000000000000000000001", _stored(event, tag), None)
    assert caught.value.rule == "stream.schema_version", str(caught.value)
    assert event_version(terminated()) == 1 and event_version(_by_ref(OutputRef(effect_id=eid(1)))) == 2


def test_the_transcript_builder_refuses_schema_versions_it_does_not_know() -> None:
    base = {
        "notification_id": 1, "tree_id": "tree:00000000000000000000000000000001", "position": 1,
        "process_id": "process:00000000000000000000000000000001", "type": "ProcessTerminated",
        "timestamp": "2026-01-01T00:00:00.000000Z", "digest": "sha256:" + "0" * 64,
    }
    with pytest.raises(SchemaVersionUnsupported):
        check_envelope({**base, "schema_version": 3, "payload": {}})
    with pytest.raises(SchemaVersionUnsupported):
        check_envelope({**base, "type": "StepCommitted", "schema_version": 2, "payload": {}})
    builder = TreeTranscripts(base["tree_id"])
    dangling = {**base, "schema_version": 2, "payload": {
        "status": "completed", "cause": "completion", "process_id": base["process_id"],
        "output_of": {"effect_id": "effect:" + "1" * 64, "path": []},
    }}
    assert builder.apply(check_envelope(dangling)) == []  # not a child whose output is reported


def test_a_reference_the_transcript_builder_cannot_resolve_is_reported_not_fatal(tmp_path: Path) -> None:
    """A consumer upgraded in the middle of a tree: its saved state (written by a release that
    kept no settlements) cannot resolve the Tool child's reference. The entry says so and the
    consumer goes on; with the settlement kept, the same envelopes give the output."""
    store = EventStore(f"sqlite:///{tmp_path / 'upgrade.db'}")
    tree_id, _ = run_interaction(store, "upgrade-1")
    envelopes = [check_envelope(envelope_of(n)) for n in store.recorder.select_notifications(start=1, limit=1000)]
    cut = next(i for i, e in enumerate(envelopes) if e["type"] == "ProcessTerminated" and "output_of" in e["payload"])

    def results(forget: bool) -> list[dict[str, Any]]:
        builder = TreeTranscripts(str(tree_id))
        entries: list[dict[str, Any]] = []
        for e in envelopes[:cut]:
            entries.extend(builder.apply(e) or [])
        state = builder.to_json()
        if forget:
            state.pop("settled")  # as saved by the release before output_of existed
        resumed = TreeTranscripts(str(tree_id), state)
        for e in envelopes[cut:]:
            entries.extend(resumed.apply(e) or [])
        return [e for e in entries if e["kind"] == "tool_result"]

    (kept,) = results(forget=False)
    assert kept["text"] == TOOL_TEXT and "output_unresolved" not in kept
    (lost,) = results(forget=True)
    assert lost["output"] is None and lost["text"] == ""
    assert lost["output_unresolved"] == envelopes[cut]["payload"]["output_of"]
    # The transcript goes on after it: the final answer is still reported.


def test_drift_compares_outputs_not_their_storage_form() -> None:
    """A history written before outputs were stored by reference (inline output) shows no drift
    against the current code, which stores a reference; a different output still does."""
    from agentfold.domain.drift import find_drift

    store = EventStore("memory:")
    tree_id, catalog = run_interaction(store, "drift-1")
    records = [(r.position, r.event) for r in store.read(tree_id)]
    tree = fold_tree([e for _, e in records])
    by_ref = [i for i, (_, e) in enumerate(records) if isinstance(e, ProcessTerminated) and e.output_of is not None]
    assert by_ref

    current = find_drift(records, catalog.resolve)
    assert current.ok and current.decisions > 3

    def inline(output: Any) -> list[tuple[int, Any]]:
        out = list(records)
        for i in by_ref:
            position, event = out[i]
            out[i] = (position, event.model_copy(update={"output": output(event), "output_of": None}))
        return out

    old_form = inline(lambda e: tree.processes[e.process_id].output)
    assert fold_tree([e for _, e in old_form]).to_json() == tree.to_json()
    report = find_drift(old_form, catalog.resolve)
    assert report.ok, report.drift
    assert report.decisions == current.decisions

    changed = inline(lambda e: {"disposition": "succeeded", "output": {"content": []}})
    drifted = find_drift(changed, catalog.resolve)
    assert drifted.drift is not None and drifted.drift.path.startswith("ProcessTerminated.output")
