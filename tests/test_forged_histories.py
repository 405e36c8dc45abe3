"""Histories with a valid digest chain that the kernel never wrote (a forged export, a hand
edit under a recomputed chain) never make a host call a dispatcher the kernel would not have
called (found by a review of crafted histories)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from agentfold.adapters.recorders import EVENTS_TABLE, TREES_TABLE
from agentfold.domain.integrity import chain_digest, content_bytes, seal, unseal
from tests.test_cli import agentfold, count, ok, start_crashing_run


def rewrite(path: Path, out: Path, edit: Any) -> None:
    """Copy an export file, ``edit(position, topic, body)`` applied to each event body, with
    its digest chain computed again (what a forger with the product's own code can do)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    previous = None
    written = []
    for line in lines:
        if "state" not in line:
            line["end"]["head_digest"] = previous
            written.append(line)
            continue
        unsealed = unseal(line["state"].encode())
        body = unsealed.body
        edit(line["position"], line["topic"], body)
        content = content_bytes(body, unsealed.timestamp)
        digest = chain_digest(previous, line["tree"], line["position"], line["topic"].split(":", 1)[1], content)
        line["state"] = seal(content, digest).decode()
        previous = digest
        written.append(line)
    out.write_text("".join(json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n" for line in written))


def test_a_declaration_forged_to_say_same_identity_is_not_dispatched_again(tmp_path: Path) -> None:
    # The review's case: the charge (policy never) dispatched, the process killed inside the
    # call; its EffectDeclared edited to `replay: same_identity` and the chain recomputed.
    # Import and `audit verify` accepted it and `recover` charged the customer a second time.
    # A call is made again only when its Program, asked again, says same_identity too.
    source = f"sqlite:///{tmp_path / 'source.db'}"
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(source, log, start_id="order-1", point="in-dispatch:1")
    assert count(log, "charge") == 1
    exported = tmp_path / "order-1.jsonl"
    ok(agentfold("export", "order-1", "--out", str(exported), store=source))
    forged = tmp_path / "forged.jsonl"
    edited: list[int] = []

    def same_identity(position: int, topic: str, body: dict[str, Any]) -> None:
        if topic.endswith(":EffectDeclared") and body.get("target") == "dispatcher" and not edited:
            body["replay"] = "same_identity"
            edited.append(position)

    rewrite(exported, forged, same_identity)
    assert edited
    target = f"sqlite:///{tmp_path / 'target.db'}"
    ok(agentfold("import", str(forged), store=target))
    ok(agentfold("recover", "--json", store=target))
    assert count(log, "charge") == 1  # not charged again
    listed = ok(agentfold("unknown", "--json", store=target)).json()["unknown_effects"]
    assert len(listed) == 1 and listed[0]["diagnostic"]["code"] == "engine.dispatch.interrupted", listed


# A timer Program whose policy (under the same identity: policies are code, not part of the
# ref) the test flips between two owners.
POLICY = {"replay": "same_identity"}


def _timer_program() -> Any:
    from agentfold.adapters.dispatch import TimerDispatcher
    from agentfold.domain.ids import Digest
    from agentfold.domain.program import (
        Complete,
        Continue,
        Descriptor,
        EffectPolicy,
        Program,
        Replay,
        Step,
        dispatcher_effect,
    )

    class Strategy:
        def initial(self, input: Any) -> Any:
            return {"at": input, "phase": "start"}

        def evolve(self, state: Any, facts: Any, consumed: int) -> Any:
            return {**state, **(facts or {})}

        def encode_state(self, state: Any) -> Any:
            return state

        def decode_state(self, data: Any) -> Any:
            return data

        def decide(self, state: Any, window: Any) -> Any:
            if state["phase"] == "start":
                return Step(0, Continue((dispatcher_effect({"at": state["at"]}),)), {"phase": "waiting"})
            return Step(len(window), Complete({"fired": window[0].status.value}), {"phase": "done"})

    class Timer(TimerDispatcher):
        def due(self, request: Any) -> float:
            return float(request.payload["at"])

    def policy(effect: Any) -> EffectPolicy:
        return EffectPolicy(Replay(POLICY["replay"]))

    return Program(Descriptor("test.flip_timer", input_schema={"type": "number"}), Strategy(), Digest.of(b"t"),
                   Digest.of(b"t"), policy=policy, dispatcher=Timer())


def test_a_timer_its_program_no_longer_replays_is_not_waited_for(tmp_path: Path) -> None:
    # Found by the review of the fix above: `recover` said it waited for such a timer and would
    # fire it ("nothing to do before its timers"), and at the instant recorded it unknown.
    import time

    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.runtime import Runtime

    program = _timer_program()
    store = EventStore(f"sqlite:///{tmp_path / 't.db'}")
    try:
        first = Runtime(store, Catalog([program]))
        handle = first.start(program, time.time() + 600, start_id="timer")
        deadline = time.monotonic() + 10
        while not first.waiting_timers(handle.tree_id) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.waiting_timers(handle.tree_id)
        first.close()  # the timer is left for the next owner (same_identity)
        with Runtime(store, Catalog([program])) as second:
            assert second.stored_far_timers(handle.tree_id, 1.0)  # as declared and as the Program says
        POLICY["replay"] = "never"
        try:
            with Runtime(store, Catalog([program])) as third:
                assert third.stored_far_timers(handle.tree_id, 1.0) is None  # adopt it: it will not be waited for
                [recovered] = third.recover(str(handle.tree_id))
                tree = third.wait_idle(recovered.tree_id)
                [unknown] = [e for p in tree.processes.values() for e in p.unknown_effects()]
                assert unknown.diagnostic is not None and unknown.diagnostic.code == "engine.dispatch.interrupted"
        finally:
            POLICY["replay"] = "same_identity"
    finally:
        store.close()


def test_a_count_forged_as_true_or_text_is_refused_at_import(tmp_path: Path) -> None:
    # pydantic's lax mode read `"step": true` (or "1", or 1.0) as 1: a history the kernel never
    # wrote imported and folded. The kernel's counts are stored as whole numbers only.
    source = f"sqlite:///{tmp_path / 'source.db'}"
    log = tmp_path / "side-effects.jsonl"
    start_crashing_run(source, log, start_id="order-1", point="in-dispatch:1")
    exported = tmp_path / "order-1.jsonl"
    ok(agentfold("export", "order-1", "--out", str(exported), store=source))
    for topic, field, value in (("StepCommitted", "step", True), ("EffectDeclared", "index", "0"),
                                ("StepCommitted", "effects", 1.0)):
        forged = tmp_path / f"forged-{field}.jsonl"
        edited: list[int] = []

        def edit(position: int, event_topic: str, body: dict[str, Any], topic: str = topic, field: str = field,
                 value: Any = value, edited: list[int] = edited) -> None:
            if event_topic.endswith(":" + topic) and body.get(field) in (0, 1) and not edited:
                body[field] = value
                edited.append(position)

        rewrite(exported, forged, edit)
        assert edited, (topic, field)
        target = f"sqlite:///{tmp_path / f'target-{field}.db'}"
        ran = agentfold("import", str(forged), "--json", store=target)
        assert ran.code != 0, (topic, field, ran.stdout)
        assert "stream.event_invalid" in ran.stdout + ran.stderr, (topic, field, ran.stdout, ran.stderr)
        assert f"position {edited[0]}" in ran.stdout + ran.stderr, (edited, ran.stdout, ran.stderr)


def test_a_tree_started_naming_another_tree_is_refused_at_import_and_on_load(tmp_path: Path) -> None:
    # The digest chain binds the id a tree is stored under, and the fold read the tree's identity
    # from its TreeStarted: a history whose TreeStarted names another tree (its start id and tree id
    # rewritten together, the chain recomputed under the stored id) imported, and `show` of the
    # stored id answered as that other run. The first event must name the tree it is stored as.
    from agentfold.adapters.eventstore import EventStore
    from agentfold.domain.ids import StartID, TreeID

    source = f"sqlite:///{tmp_path / 'source.db'}"
    start_crashing_run(source, tmp_path / "side-effects.jsonl", start_id="order-1", point="in-dispatch:1")
    exported = tmp_path / "order-1.jsonl"
    ok(agentfold("export", "order-1", "--out", str(exported), store=source))
    other = TreeID.for_start(StartID("order-2"))

    def rename(position: int, topic: str, body: dict[str, Any]) -> None:
        if position == 1:
            body["start_id"], body["tree_id"] = "order-2", str(other)

    forged = tmp_path / "forged.jsonl"
    rewrite(exported, forged, rename)
    target = f"sqlite:///{tmp_path / 'target.db'}"
    ran = agentfold("import", str(forged), "--json", store=target)
    assert ran.code == 2, (ran.code, ran.stdout, ran.stderr)
    refusal = json.loads(ran.stderr)["error"]
    assert refusal["code"] == "import.corrupt" and (refusal["detail"]["rule"], refusal["detail"]["position"]) == (
        "tree.identity", 1), refusal
    tree = TreeID.for_start(StartID("order-1"))
    store = EventStore(target)
    try:
        assert store.read_raw(tree) == []  # nothing of it was stored
    finally:
        store.close()
    # The same rows written into the store by hand (each state and the index row's head replaced
    # with the forged ones): every read refuses the tree instead of showing it as order-2.
    ok(agentfold("import", str(exported), store=target))
    lines = [json.loads(line) for line in forged.read_text().splitlines() if line.strip()]
    with sqlite3.connect(tmp_path / "target.db") as db:
        for line in lines:
            if "state" in line:
                db.execute(f"UPDATE {EVENTS_TABLE} SET state = ? WHERE originator_id = ? AND originator_version = ?",
                           (line["state"].encode(), tree.uuid.hex, line["position"]))
            else:
                db.execute(f"UPDATE {TREES_TABLE} SET head_digest = ? WHERE tree_id = ?", (line["end"]["head_digest"], str(tree)))
    shown = agentfold("show", "order-1", "--json", store=target)
    assert shown.code == 1, (shown.code, shown.stdout, shown.stderr)
    assert "tree.identity" in shown.stdout + shown.stderr and "order-2" not in shown.stdout, shown.stdout + shown.stderr
