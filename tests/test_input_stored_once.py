"""A child input that repeats an earlier sibling's is stored as its changes (EffectDeclared
``input_patch``, schema version 2): a team's Turn holds every task so far, and each turn's
Turn was stored whole, so a team's history grew with the square of its turns.

What a user observes: each task's output is stored a bounded number of times however many
turns follow (it was stored again in every later Turn), while the coordinator still gets
every task so far with its outcome, live and after a reload from SQLite; the history grows
linearly; a stream whose changes do not apply is refused (``effect.input_patch``); a Step
that writes ``input_patch`` itself is refused; drift compares inputs, not their storage form.
"""

from __future__ import annotations

import copy
import random
import string
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import TOPIC_PREFIX, DecodeError, PydanticMapper, stored_json
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import (
    DECISION_SCHEMA,
    TURN_SCHEMA,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_team,
    transform,
)
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.events import EffectDeclared, TreeEvent, event_body, event_version
from agentfold.domain.input_changes import apply_changes, input_changes
from agentfold.domain.integrity import chain_digest, content_bytes, seal
from agentfold.domain.program import Continue, Descriptor, Effect, Program, Signal, Step, Target
from agentfold.domain.tree import fold_tree
from tests.kernel_programs import IMPL, JsonStrategy, config_digest
from tests.test_fold_rules import assert_corrupt

TEXT: Any = {"type": "string"}


def _team(tasks: int, output_bytes: int, seen: list[dict[str, Any]], name: str) -> tuple[Program, Catalog]:
    """A collaboration whose coordinator starts one task per turn until ``tasks`` have started;
    each task returns ``output_bytes`` of random letters. ``seen`` gets every Turn."""
    rng = random.Random(tasks)

    def work(text: Any) -> Any:
        return "".join(rng.choice(string.ascii_letters) for _ in range(output_bytes))

    def decide(turn: dict[str, Any]) -> dict[str, Any]:
        seen.append(copy.deepcopy(turn))
        started = len(turn["tasks"])
        if started < tasks:
            return {"mode": "wait", "state": turn["state"],
                    "tasks": [{"key": f"t{started}", "worker": f"{name}.worker", "input": "go"}]}
        return {"mode": "", "state": turn["state"], "output": "done"}

    worker = transform(TransformConfig(f"{name}.worker", work, "Work.", input_schema=TEXT, output_schema=TEXT))
    coordinator = transform(TransformConfig(f"{name}.coordinator", decide, "Decide.", input_schema=TURN_SCHEMA,
                                            output_schema=DECISION_SCHEMA))
    grant = Budget(steps=Quota(100_000), effects=Quota(100_000), signals=Quota(100_000))
    team = compile_team(TeamConfig(name=name, description="One task per turn.",
                                   coordinator=TeamMember(coordinator, grant), workers=[TeamMember(worker, grant)],
                                   state_schema=TEXT, output_schema=TEXT))
    return team, Catalog([team, worker, coordinator])


def _run(store: EventStore, tasks: int, seen: list[dict[str, Any]], name: str = "once.team",
         output_bytes: int = 600) -> tuple[Any, Catalog]:
    team, catalog = _team(tasks, output_bytes, seen, name)
    with Runtime(store, catalog) as runtime:
        handle = runtime.start(team, "state", start_id=f"{name}-{tasks}")
        assert handle.result(timeout=120).status == "completed"
        runtime.wait_idle(handle.tree_id)
    return handle.tree_id, catalog


def _outputs(turn: dict[str, Any]) -> list[str]:
    return [t["outcome"]["result"]["output"] for t in turn["tasks"] if "outcome" in t]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_each_task_output_is_stored_a_bounded_number_of_times_and_every_turn_holds_all_tasks(
    tmp_path: Path, kind: str
) -> None:
    tasks = 12
    url = "memory:" if kind == "memory" else f"sqlite:///{tmp_path / 'turns.db'}"
    store = EventStore(url)
    seen: list[dict[str, Any]] = []
    tree_id, catalog = _run(store, tasks, seen)

    # The coordinator got Scope's cumulative Turn: turn n holds every task started before it,
    # each earlier one with its outcome.
    assert [t["number"] for t in seen] == list(range(1, tasks + 2))
    assert [len(t["tasks"]) for t in seen] == list(range(tasks + 1))
    outputs = _outputs(seen[-1])
    assert len(outputs) == tasks and len(set(outputs)) == tasks
    for number, turn in enumerate(seen):
        assert _outputs(turn) == outputs[:number]

    raw = store.read_raw(tree_id)
    topics = [s.topic for s in raw]
    assert topics.count(TOPIC_PREFIX + "EffectDeclared@2") == tasks  # every turn after the first
    states = [stored_json(s.state) for s in raw]
    for index, text in enumerate(outputs):
        copies = sum(state.count(text.encode()) for state in states)
        # Its worker's settlement and end, the Turn that first holds it: not once more per later
        # turn (task 0 was stored in all 12 later Turns).
        assert copies <= 3, (index, copies)

    if kind == "sqlite":
        store.close()
        reopened = EventStore(url)
        tree = reopened.load(tree_id, catalog.resolve, use_snapshot=False).state
        turns = sorted((p for p in tree.processes.values() if str(p.child_key or "").startswith("collaboration.turn.")),
                       key=lambda p: int(str(p.child_key).rsplit(".", 1)[-1]))
        assert [p.input for p in turns] == seen  # the fold rebuilds exactly what the coordinator got
        assert reopened.load(tree_id, catalog.resolve).state.to_json() == tree.to_json()  # and from its snapshot


def test_the_history_grows_linearly_with_the_turns() -> None:
    per_task = []
    for tasks in (5, 20):
        store = EventStore("memory:")
        tree_id, _ = _run(store, tasks, [], name=f"once.linear{tasks}")
        raw = store.read_raw(tree_id)
        per_task.append(sum(len(s.state) + len(s.topic) for s in raw) / tasks)
    # Stored whole, the Turns made 4x the tasks store ~2.2x the bytes per task (scripts/bench_team).
    assert per_task[1] < 1.15 * per_task[0], per_task


# -- the changes ---------------------------------------------------------------------------------


def _mutated(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` with random changes: members added, dropped and changed, arrays grown and cut."""
    if isinstance(value, dict):
        out = {k: (_mutated(v, rng, depth + 1) if rng.random() < 0.5 else v) for k, v in value.items()
               if rng.random() > 0.15}
        if rng.random() < 0.4:
            out[rng.choice(["a", "b", "new", "x y", ""])] = _leaf(rng)
        return out
    if isinstance(value, list):
        out_list = [(_mutated(v, rng, depth + 1) if rng.random() < 0.4 else v) for v in value]
        if rng.random() < 0.3:
            del out_list[rng.randrange(len(out_list) + 1):]
        if rng.random() < 0.5:
            out_list.append(_leaf(rng))
        return out_list
    return _leaf(rng) if rng.random() < 0.5 else value


def _leaf(rng: random.Random) -> Any:
    return rng.choice([None, True, False, 0, 1, -1, 1.5, -0.0, 0.0, "", "text", [], {}, [1, {"k": "v"}],
                       {"nested": [1, 2, {"deep": None}]}])


def test_changes_rebuild_exactly_the_new_input_and_leave_the_base_unchanged() -> None:
    rng = random.Random(7)
    stored = 0
    for _ in range(3000):
        base = {"number": rng.randrange(5), "tasks": [{"request": {"key": f"t{i}"}, "outcome": _leaf(rng)}
                                                      for i in range(rng.randrange(6))], "state": _leaf(rng)}
        new = _mutated(base, rng)
        before = canonical_bytes(base)
        patch = input_changes(base, new, "k")
        assert canonical_bytes(base) == before
        if patch is None:
            continue
        stored += 1
        assert canonical_bytes(apply_changes(base, patch["ops"])) == canonical_bytes(new)
        assert canonical_bytes(base) == before
        assert len(canonical_bytes(patch)) < len(canonical_bytes(new))
        # What the fold reads back (stored JSON) rebuilds it too.
        again = orjson.loads(orjson.dumps(patch))
        assert canonical_bytes(apply_changes(orjson.loads(before), again["ops"])) == canonical_bytes(new)
    assert stored > 500  # the property was exercised, not skipped


def test_a_change_of_sign_of_a_zero_is_a_change() -> None:
    # 0.0 == -0.0 in Python, but they are different JSON: without an op the input was stored whole.
    base = {"score": 0.0, "history": "x" * 200}
    for new in ({"score": -0.0, "history": "x" * 200}, {"score": [0.0, -0.0], "history": "x" * 200}):
        patch = input_changes(base, new, "k")
        assert patch is not None
        assert canonical_bytes(apply_changes(base, patch["ops"])) == canonical_bytes(new)


@pytest.mark.parametrize(("ops", "why"), [
    ({"op": "set"}, "must be a list"),
    ([{"op": "set", "path": ["a"]}], "exactly its members"),
    ([{"op": "move", "path": ["a"], "value": 1}], "set, drop or cut"),
    ([{"op": "set", "path": "a", "value": 1}], "path list"),
    ([{"op": "set", "path": ["missing", "b"], "value": 1}], "not there"),
    ([{"op": "set", "path": ["list", 5], "value": 1}], "does not apply"),
    ([{"op": "set", "path": ["list", True], "value": 1}], "does not apply"),
    ([{"op": "drop", "path": ["nope"]}], "not there"),
    ([{"op": "drop", "path": []}], "whole input"),
    ([{"op": "cut", "path": ["list"], "length": 9}], "at least that length"),
    ([{"op": "cut", "path": ["a"], "length": 0}], "no array"),
    ([{"op": "set", "path": ["a", "b"], "value": 1}], "does not apply"),
])
def test_ops_that_are_not_changes_of_the_base_are_refused(ops: Any, why: str) -> None:
    base = {"a": 1, "list": [1, 2]}
    with pytest.raises(ValueError, match=why):
        apply_changes(base, ops)
    assert base == {"a": 1, "list": [1, 2]}


# -- the fold rule and the schema version -------------------------------------------------------


def _team_events() -> tuple[list[TreeEvent], list[int]]:
    store = EventStore("memory:")
    tree_id, _ = _run(store, 3, [], name="once.rules")
    events = [r.event for r in store.read(tree_id)]
    patched = [i for i, e in enumerate(events) if isinstance(e, EffectDeclared) and event_version(e) == 2]
    assert len(patched) == 3
    return events, patched


def _with_payload(events: list[TreeEvent], index: int, change: Any) -> tuple[list[TreeEvent], TreeEvent]:
    event = events[index]
    assert isinstance(event, EffectDeclared)
    payload = copy.deepcopy(event.payload)
    change(payload)
    bad = event.model_copy(update={"payload": payload})
    return [*events[:index], bad, *events[index + 1:]], bad


@pytest.mark.parametrize("case", ["unknown-base", "own-key", "not-applying", "malformed", "extra-member"])
def test_a_stream_whose_input_changes_do_not_hold_is_refused(case: str) -> None:
    events, patched = _team_events()
    index = patched[-1]

    def change(payload: dict[str, Any]) -> None:
        patch = payload["input_patch"]
        if case == "unknown-base":
            patch["base"] = "collaboration.turn.99"
        elif case == "own-key":
            patch["base"] = payload["key"]  # not started before: this is its own start
        elif case == "not-applying":
            patch["ops"].append({"op": "drop", "path": ["no such member"]})
        elif case == "malformed":
            payload["input_patch"] = {"base": patch["base"]}
        else:
            patch["note"] = 1

    bad_events, bad = _with_payload(events, index, change)
    assert event_version(bad) == 2
    assert_corrupt(bad_events, bad, "effect.input_patch")
    assert fold_tree(events).root.terminal  # the untouched stream folds to the end


def test_an_input_patch_member_beside_an_input_or_on_another_operation_is_read_as_older_releases_read_it() -> None:
    """Older releases kept a framework payload's unknown members unread: such a history (a
    start with its input and an input_patch member, a wait with one) still folds, at version 1."""
    events, patched = _team_events()
    tree = fold_tree(events)
    index = patched[-1]
    started = next(p for p in tree.processes.values() if p.start_effect_id == events[index].effect_id)  # type: ignore[attr-defined]
    both, bad = _with_payload(events, index, lambda p: p.update(input=started.input))
    assert event_version(bad) == 1
    assert next(p for p in fold_tree(both).processes.values() if p.process_id == started.process_id).input == started.input
    wait = next(i for i, e in enumerate(events) if isinstance(e, EffectDeclared) and e.target == "framework"
                and e.payload.get("operation") == "wait_children")
    other, bad = _with_payload(events, wait, lambda p: p.update(input_patch={"base": "x", "ops": []}))
    assert event_version(bad) == 1
    assert fold_tree(other).root.terminal


def _stored(event: TreeEvent, tag: str) -> StoredEvent:
    tree_id = "tree:00000000000000000000000000000001"
    content = content_bytes(event_body(event), "2026-01-01T00:00:00.000000Z")
    return StoredEvent(uuid.UUID(int=1), 7, TOPIC_PREFIX + tag, seal(content, chain_digest(None, tree_id, 7, tag, content)))


def test_a_topic_whose_schema_version_does_not_fit_the_declaration_is_refused() -> None:
    events, patched = _team_events()
    v2 = events[patched[0]]
    v1 = next(e for e in events if isinstance(e, EffectDeclared) and event_version(e) == 1)
    mapper = PydanticMapper(transcoder=None)  # type: ignore[arg-type]
    for event, tag in ((v1, "EffectDeclared@2"), (v1, "EffectDeclared@3"), (v2, "EffectDeclared@3")):
        with pytest.raises(DecodeError) as caught:
            mapper.decode("tree:00000000000000000000000000000001", _stored(event, tag), None)
        assert caught.value.rule == "stream.schema_version", str(caught.value)
    for event, tag in ((v2, "EffectDeclared@2"), (v1, "EffectDeclared")):
        decoded = mapper.decode("tree:00000000000000000000000000000001", _stored(event, tag), None)
        assert decoded.event == event


def test_a_version_1_start_with_an_input_patch_member_and_no_input_is_read_as_earlier_releases_read_it() -> None:
    """Before 2026-12-05 a Step's own start_child payload could hold an input_patch member and no
    input: releases then stored it at version 1 and started the child with no input. Such a
    history still decodes (the payload marked UnreadPatch), folds as then, and re-encodes to
    the very bytes stored (its digest chain holds)."""
    from agentfold.domain.input_changes import UnreadPatch

    events, patched = _team_events()
    index = patched[-1]
    stored = _stored(events[index], "EffectDeclared")  # the same body, under a version-1 topic
    mapper = PydanticMapper(transcoder=None)  # type: ignore[arg-type]
    decoded = mapper.decode("tree:00000000000000000000000000000001", stored, None).event
    assert isinstance(decoded, EffectDeclared) and type(decoded.payload) is UnreadPatch
    assert event_version(decoded) == 1
    assert content_bytes(event_body(decoded), "2026-01-01T00:00:00.000000Z") == content_bytes(
        event_body(events[index]), "2026-01-01T00:00:00.000000Z")
    old = [*events[:index], decoded, *events[index + 1:]]
    tree = fold_tree(old)
    child = next(p for p in tree.processes.values() if p.start_effect_id == decoded.effect_id)
    assert child.input is None  # no input, as the releases that wrote it read it


# -- the kernel ----------------------------------------------------------------------------------


class _WritesAPatch(JsonStrategy):
    def decide(self, state: Any, window: Any) -> Step:
        effect = Effect(Target.FRAMEWORK, {"operation": "start_child", "key": "c", "program": "x+sha256:" + "0" * 64,
                                           "input_patch": {"base": "b", "ops": []}})
        return Step(0, Continue((effect,)), {"phase": "started"})


def test_a_step_that_writes_input_changes_itself_is_refused_and_nothing_is_declared() -> None:
    program = Program(Descriptor("once.writes", input_schema={"type": "object"}), _WritesAPatch(), IMPL,
                      config_digest("once.writes"))
    store = EventStore("memory:")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {}, start_id="writes-a-patch")
        result = handle.result(timeout=30)
    assert result.status == "failed"
    assert result.termination is not None and result.termination["failure"]["code"] == "execution.effect.invalid"
    assert "input_patch" in result.termination["failure"]["message"]
    assert not [r for r in store.read(handle.tree_id) if isinstance(r.event, EffectDeclared)]


class _StartsTwo(JsonStrategy):
    """Starts child ``a`` with ``first`` then child ``b`` with ``second``, naming ``like`` as
    ``b``'s base; completes with the outputs of both."""

    def __init__(self, like: str, child: Any, first: Any, second: Any) -> None:
        self.like, self.child, self.first, self.second = like, child, first, second

    def decide(self, state: Any, window: list[Signal]) -> Step:
        from agentfold.domain.ids import ChildKey, ProcessID, WaitKey
        from agentfold.domain.program import ChildSpec, ChildWaitSpec, Complete, Wait, start_child_effect
        from agentfold.domain.program import wait_children_effect as waits

        phase = state.get("phase", "start")
        if phase == "start":
            spec = ChildSpec(ChildKey("a"), self.child.ref, self.first)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "a"})
        if phase == "a":
            spec = ChildSpec(ChildKey("b"), self.child.ref, self.second)
            a = window[0].payload["process_id"]
            return Step(1, Continue((start_child_effect(spec, input_like=self.like),)), {"phase": "b", "a": a})
        if phase == "b":
            children = (ProcessID(state["a"]), ProcessID(window[0].payload["process_id"]))
            return Step(1, Continue((waits(ChildWaitSpec(WaitKey("both"), children)),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        outcomes = window[0].payload["outcomes"]
        return Step(1, Complete([o["result"].get("output") for o in outcomes]), {"phase": "done"})


class _Keys(JsonStrategy):
    """Completes with the order of its input's members, after taking one item out of its input
    in place (a Program may do either: nothing forbids it)."""

    def initial(self, input: Any) -> Any:
        order = list(input)
        if isinstance(input.get("items"), list) and input["items"]:
            input["items"].pop()
        return {"order": order, "phase": "start"}

    def decide(self, state: Any, window: Any) -> Step:
        from agentfold.domain.program import Complete

        return Step(0, Complete(state["order"]), {"phase": "done"})


def _parent_of_two(like: str, first: Any, second: Any, name: str) -> tuple[Program, Catalog]:
    child = Program(Descriptor(f"{name}.child", input_schema={"type": "object"}), _Keys(), IMPL,
                    config_digest(f"{name}.child"))
    parent = Program(Descriptor(name, input_schema={"type": "object"}), _StartsTwo(like, child, first, second), IMPL,
                     config_digest(name), children=(child,))
    return parent, Catalog([parent])


BIG = {"b": "x" * 300, "items": ["y" * 100, "z" * 100], "n": 1}


@pytest.mark.parametrize(("like", "stored_as"), [("a", "changes"), ("nobody", "whole")])
def test_the_kernel_stores_changes_only_from_a_sibling_that_exists(like: str, stored_as: str, tmp_path: Path) -> None:
    second = {**BIG, "aa": 2}  # a new member that sorts between two of the base's
    parent, catalog = _parent_of_two(like, BIG, second, f"once.two.{like}")
    url = f"sqlite:///{tmp_path / 'two.db'}"
    store = EventStore(url)
    with Runtime(store, catalog) as runtime:
        handle = runtime.start(parent, {}, start_id=f"starts-two-{like}")
        result = handle.result(timeout=30)
        live = runtime.capture(handle.tree_id)
    assert result.status == "completed"
    # Each child saw its input's members in key order, as a stored input decodes, live and replayed.
    assert sorted(result.output, key=len) == [["b", "items", "n"], ["aa", "b", "items", "n"]]
    raw = store.read_raw(handle.tree_id)
    declared = [orjson.loads(stored_json(s.state))["event"]["payload"] for s in raw if "EffectDeclared" in s.topic]
    if stored_as == "changes":
        assert "input" not in declared[1] and declared[1]["input_patch"]["base"] == "a"
    else:
        assert declared[1]["input"] == second and "input_patch" not in declared[1]
    store.close()
    reopened = EventStore(url)
    tree = reopened.load(handle.tree_id, catalog.resolve, use_snapshot=False).state
    inputs = {str(p.child_key): p.input for p in tree.processes.values() if p.child_key}
    assert inputs == {"a": BIG, "b": second}  # the child's pop() in initial changed neither
    assert tree.to_json() == live.to_json()
    from agentfold.domain.drift import find_drift

    report = find_drift([(r.position, r.event) for r in reopened.read(handle.tree_id)], catalog.resolve)
    assert report.ok, report.drift


class _WaitsWithAPatchMember(JsonStrategy):
    def decide(self, state: Any, window: Any) -> Step:
        from agentfold.domain.program import Complete

        if state["phase"] == "start":
            effect = Effect(Target.FRAMEWORK, {"operation": "wait", "key": "k", "input_patch": {"base": "b", "ops": []}})
            return Step(0, Continue((effect,)), {"phase": "opened"})
        return Step(1, Complete("done"), {"phase": "done"})


def test_an_input_patch_member_of_another_framework_payload_is_kept_unread_as_before(tmp_path: Path) -> None:
    program = Program(Descriptor("once.waitpatch", input_schema={"type": "object"}), _WaitsWithAPatchMember(), IMPL,
                      config_digest("once.waitpatch"))
    url = f"sqlite:///{tmp_path / 'wait.db'}"
    store = EventStore(url)
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {}, start_id="wait-with-a-patch-member")
        assert handle.result(timeout=30).status == "completed"
    raw = store.read_raw(handle.tree_id)
    assert TOPIC_PREFIX + "EffectDeclared" in [s.topic for s in raw]  # version 1, as older releases wrote it
    store.close()
    assert EventStore(url).load(handle.tree_id, use_snapshot=False).state.root.terminal


def test_the_transcript_builder_rebuilds_an_interaction_input_stored_as_changes(tmp_path: Path) -> None:
    """A Program that starts Interactions in turn, each with the conversation so far (input_like
    the one before): the transcript of each shows its whole input."""
    from agentfold.adapters.feed import envelope_of
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.models import ScriptedModel
    from agentfold.projections.transcripts import TreeTranscripts, check_envelope

    answer = {"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    chat = compile_interaction(InteractionConfig(name="once.chat", model=ScriptedModel([answer, answer])))
    history = [{"role": "user", "content": "hello " * 60}, {"role": "assistant", "content": "hi " * 60}]
    first = {"messages": history[:1]}
    second = {"messages": [*history, {"role": "user", "content": "and then?"}]}
    parent = Program(Descriptor("once.chats", input_schema={"type": "object"}), _StartsTwo("a", chat, first, second),
                     IMPL, config_digest("once.chats"), children=(chat,))
    store = EventStore(f"sqlite:///{tmp_path / 'chats.db'}")
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, {}, start_id="chats")
        assert handle.result(timeout=30).status == "completed"
    topics = [s.topic for s in store.read_raw(handle.tree_id)]
    assert TOPIC_PREFIX + "EffectDeclared@2" in topics  # the second start is stored as changes
    builder = TreeTranscripts(str(handle.tree_id))
    entries: list[dict[str, Any]] = []
    for n in store.recorder.select_notifications(start=1, limit=1000):
        entries.extend(builder.apply(check_envelope(envelope_of(n))) or [])
    shown: dict[str, list[str]] = {}
    for e in entries:
        if e["kind"] == "input_message":
            shown.setdefault(e["process_id"], []).append(e["text"])
    assert sorted(shown.values(), key=len) == [[m["content"] for m in first["messages"]],
                                               [m["content"] for m in second["messages"]]]
    assert orjson.loads(orjson.dumps(builder.to_json()))["last_inputs"] == {}  # dropped once the parent ended


def test_drift_compares_inputs_not_their_storage_form() -> None:
    from agentfold.domain.drift import find_drift

    store = EventStore("memory:")
    tree_id, catalog = _run(store, 4, [], name="once.drift")
    records = [(r.position, r.event) for r in store.read(tree_id)]
    tree = fold_tree([e for _, e in records])
    current = find_drift(records, catalog.resolve)
    assert current.ok and current.decisions > 5

    def whole(index: int, event: EffectDeclared, change: Any = None) -> tuple[int, TreeEvent]:
        started = next(p for p in tree.processes.values() if p.start_effect_id == event.effect_id)
        payload = {k: v for k, v in event.payload.items() if k != "input_patch"}
        payload["input"] = change(started.input) if change else started.input
        return records[index][0], event.model_copy(update={"payload": payload})

    patched = [i for i, (_, e) in enumerate(records) if isinstance(e, EffectDeclared) and event_version(e) == 2]
    old_form = list(records)
    for i in patched:
        old_form[i] = whole(i, records[i][1])  # type: ignore[arg-type]
    assert fold_tree([e for _, e in old_form]).to_json() == tree.to_json()
    report = find_drift(old_form, catalog.resolve)
    assert report.ok, report.drift
    assert report.decisions == current.decisions

    changed = list(records)
    changed[patched[-1]] = whole(patched[-1], records[patched[-1]][1], lambda turn: {**turn, "state": "other"})  # type: ignore[arg-type]
    drifted = find_drift(changed, catalog.resolve)
    assert drifted.drift is not None and drifted.drift.path.startswith("EffectDeclared.payload.input"), drifted


def test_feed_envelopes_carry_the_changes_and_a_consumer_rebuilds_every_turn_from_them(tmp_path: Path) -> None:
    """docs/kafka.md's recipe: keep each collaboration's last Turn, apply the next one's ops."""
    from agentfold.adapters.feed import envelope_of
    from agentfold.projections.transcripts import TreeTranscripts, check_envelope

    store = EventStore(f"sqlite:///{tmp_path / 'feed.db'}")
    seen: list[dict[str, Any]] = []
    tree_id, _ = _run(store, 5, seen, name="once.feed")
    envelopes = [check_envelope(envelope_of(n)) for n in store.recorder.select_notifications(start=1, limit=10_000)]
    builder = TreeTranscripts(str(tree_id))
    for envelope in envelopes:  # the transcript consumer takes every one (it knows EffectDeclared 2)
        builder.apply(envelope)
    assert builder.position == len(envelopes)

    turns: dict[str, Any] = {}  # child key -> Turn, as a consumer keeps them
    rebuilt = []
    for envelope in envelopes:
        payload = envelope["payload"]
        if envelope["type"] != "EffectDeclared" or payload.get("payload", {}).get("operation") != "start_child":
            continue
        start = payload["payload"]
        if not str(start["key"]).startswith("collaboration.turn."):
            continue
        if "input_patch" in start:
            assert envelope["schema_version"] == 2 and "input" not in start
            turn = apply_changes(turns[start["input_patch"]["base"]], start["input_patch"]["ops"])
        else:
            assert envelope["schema_version"] == 1
            turn = start["input"]
        turns[start["key"]] = turn
        rebuilt.append(turn)
    assert rebuilt == seen
    assert sum(1 for e in envelopes if e["schema_version"] == 2 and e["type"] == "EffectDeclared") == 5


def test_a_coordinator_that_changes_the_turn_it_is_given_changes_no_later_turn(tmp_path: Path) -> None:
    """The function gets its own copy: a Turn changed in place must neither reach the next
    Turn's stored changes nor make the run differ after a reload."""
    url = f"sqlite:///{tmp_path / 'mutating.db'}"
    seen: list[dict[str, Any]] = []

    def worker_fn(text: Any) -> Any:
        return "out-" + str(text)

    def decide(turn: dict[str, Any]) -> dict[str, Any]:
        seen.append(copy.deepcopy(turn))
        started = len(turn["tasks"])
        decision = ({"mode": "wait", "state": turn["state"], "tasks": [{"key": f"t{started}", "worker": "once.mut.worker",
                                                                          "input": "go" * 100}]}
                    if started < 4 else {"mode": "", "state": turn["state"], "output": "done"})
        turn["tasks"].append({"request": {"key": "junk", "worker": "nobody", "input": "x" * 500}})  # in place
        turn["number"] = -1
        for task in turn["tasks"]:
            task.pop("outcome", None)
        return decision

    worker = transform(TransformConfig("once.mut.worker", worker_fn, "Work.", input_schema=TEXT, output_schema=TEXT))
    coordinator = transform(TransformConfig("once.mut.coordinator", decide, "Decide.", input_schema=TURN_SCHEMA,
                                            output_schema=DECISION_SCHEMA))
    grant = Budget(steps=Quota(10_000), effects=Quota(10_000), signals=Quota(10_000))
    team = compile_team(TeamConfig(name="once.mut", description="Changes its Turn.",
                                   coordinator=TeamMember(coordinator, grant), workers=[TeamMember(worker, grant)],
                                   state_schema=TEXT, output_schema=TEXT))
    catalog = Catalog([team, worker, coordinator])
    store = EventStore(url)
    with Runtime(store, catalog) as runtime:
        handle = runtime.start(team, "state", start_id="mutating")
        assert handle.result(timeout=60).status == "completed"
        live = runtime.capture(handle.tree_id)
    assert [len(t["tasks"]) for t in seen] == [0, 1, 2, 3, 4]
    assert all(len(_outputs(t)) == len(t["tasks"]) for t in seen)  # every earlier task has its outcome
    store.close()
    tree = EventStore(url).load(handle.tree_id, catalog.resolve, use_snapshot=False).state
    turns = sorted((p for p in tree.processes.values() if str(p.child_key or "").startswith("collaboration.turn.")),
                   key=lambda p: int(str(p.child_key).rsplit(".", 1)[-1]))
    assert [p.input for p in turns] == seen
    assert tree.to_json() == live.to_json()


class _StartsThree(JsonStrategy):
    """Starts ``a``, ``b`` and ``c`` (one per Step, same Program), ``c`` with ``input_like``
    ``like``, and ``b`` with an extra ``payload`` member; completes once all three started."""

    def __init__(self, like: str, child: Any, extra: dict[str, Any]) -> None:
        self.like, self.child, self.extra = like, child, extra

    def decide(self, state: Any, window: list[Signal]) -> Step:
        from agentfold.domain.ids import ChildKey
        from agentfold.domain.program import ChildSpec, Complete, start_child_effect

        phase = state.get("phase", "start")
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("a"), self.child.ref, BIG)),)),
                        {"phase": "a"})
        if phase == "a":
            b = start_child_effect(ChildSpec(ChildKey("b"), self.child.ref, {**BIG, "n": 2}))
            if self.extra:
                b = Effect(Target.FRAMEWORK, {**b.payload, **self.extra})  # type: ignore[dict-item]
            return Step(1, Continue((b,)), {"phase": "b"})
        if phase == "b":
            spec = ChildSpec(ChildKey("c"), self.child.ref, {**BIG, "n": 3})
            return Step(1, Continue((start_child_effect(spec, input_like=self.like),)), {"phase": "c"})
        return Step(1, Complete(None), {"phase": "done"})


@pytest.mark.parametrize(("like", "stored_as"), [("b", "changes"), ("a", "whole")])
def test_changes_are_stored_only_from_the_last_child_of_the_same_program(like: str, stored_as: str) -> None:
    """A consumer of the feed keeps the last child input of each Program a Process started
    (docs/kafka.md): a hint naming an earlier one is ignored, the input stored whole."""
    child = Program(Descriptor("once.three.child", input_schema={"type": "object"}), _Keys(), IMPL,
                    config_digest("once.three.child"))
    parent = Program(Descriptor(f"once.three.{like}", input_schema={"type": "object"}),
                     _StartsThree(like, child, {}), IMPL, config_digest(f"once.three.{like}"), children=(child,))
    store = EventStore("memory:")
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, {}, start_id=f"three-{like}")
        assert handle.result(timeout=30).status == "completed"
    declared = [orjson.loads(stored_json(s.state))["event"]["payload"] for s in store.read_raw(handle.tree_id)
                if "EffectDeclared" in s.topic]
    third = declared[2]
    assert ("input_patch" in third) == (stored_as == "changes"), third
    tree = store.load(handle.tree_id).state
    assert next(p for p in tree.processes.values() if p.child_key == "c").input == {**BIG, "n": 3}


def test_a_step_start_with_both_an_input_and_an_input_patch_member_keeps_the_member_unread() -> None:
    """As releases before 2026-12-05 did (the kernel refuses only a patch it would take for its own)."""
    child = Program(Descriptor("once.both.child", input_schema={"type": "object"}), _Keys(), IMPL,
                    config_digest("once.both.child"))
    extra = {"input_patch": {"base": "a", "ops": [{"op": "set", "path": ["n"], "value": 99}]}}
    parent = Program(Descriptor("once.both", input_schema={"type": "object"}), _StartsThree("nobody", child, extra),
                     IMPL, config_digest("once.both"), children=(child,))
    store = EventStore("memory:")
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, {}, start_id="both")
        assert handle.result(timeout=30).status == "completed"
    assert TOPIC_PREFIX + "EffectDeclared@2" not in [s.topic for s in store.read_raw(handle.tree_id)]
    tree = store.load(handle.tree_id, use_snapshot=False).state
    assert next(p for p in tree.processes.values() if p.child_key == "b").input == {**BIG, "n": 2}


def test_the_transcript_builder_keeps_no_turn_in_its_saved_state(tmp_path: Path) -> None:
    """It keeps only the members it reads of the last inputs (a coordinator's Turn has none)."""
    from agentfold.adapters.feed import envelope_of
    from agentfold.projections.transcripts import TreeTranscripts, check_envelope

    store = EventStore(f"sqlite:///{tmp_path / 'state.db'}")
    tree_id, _ = _run(store, 12, [], name="once.state", output_bytes=1024)
    builder = TreeTranscripts(str(tree_id))
    largest = 0
    for n in store.recorder.select_notifications(start=1, limit=10_000):
        builder.apply(check_envelope(envelope_of(n)))
        largest = max(largest, len(orjson.dumps(builder.to_json())))
    # 12 one-KiB outputs: the last Turn alone is over 12 KB.
    assert largest < 6_000, largest


def test_folding_a_team_history_keeps_memory_linear_in_its_turns() -> None:
    """The rebuilt Turns share what they repeat with the Turn before (a copy of each whole Turn
    made a fold's memory grow with the square of the turns again)."""
    import tracemalloc

    kept = []
    for tasks in (10, 40):
        store = EventStore("memory:")
        tree_id, _ = _run(store, tasks, [], name=f"once.memory{tasks}", output_bytes=1024)
        events = [r.event for r in store.read(tree_id)]
        tracemalloc.start()
        try:
            tree = fold_tree(events)
            kept.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        assert tree.root.terminal
    assert kept[1] < 6 * kept[0], kept  # 4x the turns: ~4x linear, ~16x quadratic
