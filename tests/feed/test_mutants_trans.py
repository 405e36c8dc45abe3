"""Tests written by the mutation audit of product transcripts (session 31, "trans").

Each test kills mutants (deliberate, plausible bugs) of ``agentfold/projections/transcripts.py``
or ``agentfold/adapters/transcripts.py`` that no other test killed; its docstring names them and
the promise of docs/kafka.md ("Transcripts") they break. The runs are real Interactions driven
in-process by a :class:`Runtime` on an SQLite store (scripted models, as ``tests/feed/workload``),
and their envelopes are the ones the publisher would produce (``store_envelopes``); where a path
cannot be reached by a scripted run (a Delegate start the kernel refuses), the envelopes are
built by hand, as ``test_transcripts_pure.py`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import store_envelopes
from agentfold.adapters.interaction import steer_signal
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_catalog, scenario_program, validate_scenario
from agentfold.adapters.transcripts import TranscriptStore
from agentfold.domain.ids import EffectID, ProcessID
from agentfold.domain.interaction.refs import delegate_child_key
from agentfold.domain.interaction.settle import settle_model_result
from agentfold.domain.requests import Settlement, effect_request
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import unknown_effects
from agentfold.projections.transcripts import build_transcripts


def _call(call_id: str, name: str, arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": arguments}


def _final(text: str) -> dict[str, Any]:
    return {"finish_reason": "stop", "message": {"content": text}}


#: One round of four calls: a tool that is not bound (refused by the Interaction, index 0), then
#: three Delegates that end in another order than they were called: ``slow`` (index 1) waits on a
#: model call whose outcome is unknown (and is steered meanwhile), ``fast`` (index 2) completes at
#: once, ``broken`` (index 3) fails at once.
OUT_OF_ORDER: dict[str, Any] = {
    "name": "trans-out-of-order",
    "limits": {"max_concurrent_tool_calls": 4},
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "Delegating.", "tool_calls": [
            _call("c_tele", "teleport"), _call("c_slow", "slow", '{"topic": "a"}'),
            _call("c_fast", "fast", '{"topic": "b"}'), _call("c_broken", "broken", '{"topic": "c"}'),
        ]}},
        _final("All three reported."),
    ]},
    "tools": [{"name": "lookup", "result": {"output": "unused"}}],
    "delegates": [
        {"name": "slow", "input_schema": {"type": "object"}, "scenario": {"name": "slow", "model": {"responses": [
            {"error": "model overloaded"}, _final("slow done, briefly")]}}},
        {"name": "fast", "input_schema": {"type": "object"}, "scenario": {"name": "fast", "model": {"responses": [
            _final("fast done")]}}},
        {"name": "broken", "input_schema": {"type": "object"}, "scenario": {"name": "broken", "model": {"responses": [
            {"finish_reason": "content_filter", "message": {"content": "Filtered.",
                                                            "tool_calls": [_call("x", "nothing")]}}]}}},
    ],
}

#: A model call whose outcome is unknown (the script raises).
MODEL_UNKNOWN: dict[str, Any] = {"name": "trans-model-unknown", "model": {"responses": [{"error": "model overloaded"}]}}


class _Runs:
    """Runs on one SQLite store in ``folder``, driven in-process."""

    def __init__(self, folder: Path, doc: dict[str, Any]) -> None:
        self.store = EventStore(f"sqlite:///{folder / 'store.db'}")
        self.doc = validate_scenario(doc)
        self.program = scenario_program(self.doc)
        self.runtime = Runtime(self.store, scenario_catalog(self.program), poll_interval=0)

    def start(self) -> tuple[Any, TreeState]:
        handle = self.runtime.start(self.program, {"messages": [{"role": "user", "content": "go"}]},
                                    start_id="trans", configuration=self.doc)
        return handle.tree_id, self.runtime.wait_idle(handle.tree_id, 30)

    def the_unknown(self, tree: TreeState) -> tuple[ProcessID, EffectID, Any]:
        (unknown,) = unknown_effects(tree, self.runtime.catalog.resolve)
        pid = ProcessID(unknown["process_id"])
        program = self.runtime.catalog.resolve(tree.processes[pid].program)
        assert program is not None
        eid = EffectID(unknown["effect_id"])
        return pid, eid, (program, effect_request(tree, pid, eid, program))

    def transcripts(self) -> dict[str, dict[str, Any]]:
        return build_transcripts(store_envelopes(self.store))

    def close(self) -> None:
        self.runtime.close()
        self.store.close()


def _kinds(transcript: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in transcript["entries"]]


@pytest.fixture(scope="module")
def out_of_order(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, dict[str, Any]], list[Any]]:
    """The root, the transcripts and the envelopes of one OUT_OF_ORDER run (completed)."""
    runs = _Runs(tmp_path_factory.mktemp("trans-order"), OUT_OF_ORDER)
    try:
        tree_id, tree = runs.start()
        slow, _, _ = runs.the_unknown(tree)
        runs.runtime.deliver_signals(slow, [steer_signal("steer-slow", {"role": "user", "content": "be brief"})])
        tree = runs.runtime.wait_idle(tree_id, 30)
        pid, eid, (program, request) = runs.the_unknown(tree)
        assert pid == slow
        runs.runtime.resolve_unknown_effect(eid, settle_model_result(
            program, request, {"finish_reason": "stop", "message": {"role": "assistant", "content": "slow done"}},
        ), process_id=pid)
        tree = runs.runtime.wait_idle(tree_id, 30)
        assert tree.root.status == "completed", tree.root.termination
        return str(tree.root.process_id), runs.transcripts(), list(store_envelopes(runs.store))
    finally:
        runs.close()


def test_delegates_that_end_out_of_order_each_get_their_own_result_under_their_own_call(out_of_order: Any) -> None:
    """Mutants T7 (a Delegate child's output kept under the next free slot of its batch, i.e. in
    the order the children ended, not under its call's index) and T13 (a failed Delegate's
    result given at its offset in the batch instead of its call's index): with Delegates that
    end in another order than they were called, or a batch that does not start at the round's
    first call, the model-visible results were attached to the wrong calls (a result shown
    under another Delegate's ToolCallRef, one call's result lost). The scripted runs had one
    Delegate per round, at the batch's start, so no test saw it.

    docs/kafka.md "Entry kinds": every tool call of an admitted round gets exactly one
    ``tool_result``; a ``delegate_result`` and the Delegate's ``tool_result`` name its call."""
    root, transcripts, _ = out_of_order
    t = transcripts[root]
    calls = {c["name"]: c["tool_call_ref"] for e in t["entries"] if e["kind"] == "assistant_message"
             for c in e["tool_calls"]}
    assert calls == {"teleport": f"{root}/1/0", "slow": f"{root}/1/1", "fast": f"{root}/1/2", "broken": f"{root}/1/3"}
    children = {h["tool_call_ref"]: pid for pid, h in transcripts.items() if pid != root}
    ended = [(e["tool_call_ref"], e["status"]) for e in t["entries"] if e["kind"] == "delegate_result"]
    assert ended == [(calls["fast"], "completed"), (calls["broken"], "failed"), (calls["slow"], "completed")]
    results = [e for e in t["entries"] if e["kind"] == "tool_result"]
    assert sorted(r["tool_call_ref"] for r in results) == sorted(calls.values())
    by_ref = {r["tool_call_ref"]: r for r in results}
    for name in ("slow", "fast"):
        result = by_ref[calls[name]]
        # The Delegate's own final answer, as its child transcript ends with it.
        final = transcripts[children[calls[name]]]["entries"][-1]
        assert final["kind"] == "final_output"
        assert (result["tool_name"], result["source"], result["disposition"]) == (name, "delegate", "succeeded")
        assert result["output"] == {"details": final["output"]}
    assert by_ref[calls["slow"]]["output"]["details"]["model_response"]["message"]["content"] == [
        {"type": "text", "text": "slow done, briefly"}]
    assert by_ref[calls["fast"]]["output"]["details"]["model_response"]["message"]["content"] == [
        {"type": "text", "text": "fast done"}]
    broken = by_ref[calls["broken"]]
    assert (broken["tool_name"], broken["source"], broken["disposition"]) == ("broken", "interaction", "failed")
    assert broken["text"].startswith("error: delegated worker child ended with failed")


def test_a_delegate_childs_unknown_model_call_and_steering_are_in_its_own_transcript(out_of_order: Any) -> None:
    """Mutant T4 (projections ``_owner``: a Delegate child reports to its parent, as a Tool child
    does): the unknown outcome of the Delegate's own model call and its resolution were shown in
    the parent's transcript (under the Delegate's call), and the steering message sent to the
    Delegate was in no transcript at all. No run steered a Delegate or left its model call
    unknown.

    docs/kafka.md "Which processes have a transcript": a Delegate child that is an Interaction
    has its own transcript; only Tool children report in their Interaction's."""
    root, transcripts, _ = out_of_order
    assert not {"unknown_outcome", "unknown_resolved", "steering"} & set(_kinds(transcripts[root]))
    (slow,) = [t for pid, t in transcripts.items() if t["tool_call_ref"] == f"{root}/1/1"]
    assert slow["parent_process_id"] == root and slow["status"] == "completed"
    assert _kinds(slow) == ["input_message", "unknown_outcome", "steering", "unknown_resolved", "assistant_message",
                            "assistant_message", "final_output"]
    unknown, steering, resolved = slow["entries"][1:4]
    assert (unknown["effect_kind"], unknown["model_call_sequence"]) == ("model", 1)
    assert "tool_call_ref" not in unknown and "tool_call_ref" not in resolved
    assert (steering["signal_id"], steering["text"]) == ("steer-slow", "be brief")
    assert (resolved["effect_id"], resolved["status"]) == (unknown["effect_id"], "succeeded")
    assert slow["entries"][5]["applied_steer_signal_ids"] == ["steer-slow"]


def test_a_model_call_a_host_resolved_as_failed_is_no_reply_and_the_transcript_ends_in_failure(tmp_path: Path) -> None:
    """Mutants T5 (a resolution that is not ``succeeded`` still made an ``assistant_message``)
    and T6 (``unknown_resolved`` always said ``succeeded``): a model call whose outcome a host
    established as failed was shown as an (empty) assistant reply, or as a success, before the
    Interaction's failure. Every resolution in the scripted runs succeeded.

    docs/kafka.md "Entry kinds": ``unknown_resolved`` has the resolution's ``status`` and
    ``payload``; an ``assistant_message`` is made by a model call's settlement or its host
    resolution (a response), a ``failure`` by an Interaction that ended otherwise."""
    runs = _Runs(tmp_path, MODEL_UNKNOWN)
    try:
        tree_id, tree = runs.start()
        pid, eid, _ = runs.the_unknown(tree)
        runs.runtime.resolve_unknown_effect(eid, Settlement.failed({"why": "the provider never answered"}),
                                            process_id=pid)
        tree = runs.runtime.wait_idle(tree_id, 30)
        assert tree.root.status == "failed"
        t = runs.transcripts()[str(pid)]
    finally:
        runs.close()
    assert _kinds(t) == ["input_message", "unknown_outcome", "unknown_resolved", "failure"]
    unknown, resolved, failure = t["entries"][1:]
    assert (resolved["effect_id"], resolved["effect_kind"], resolved["status"], resolved["resolved_by"]) == (
        unknown["effect_id"], "model", "failed", "host")
    assert resolved["payload"] == {"why": "the provider never answered"}
    assert t["status"] == failure["status"] == "failed"
    assert failure["failure"]["code"] == "interaction.host.failed"


def test_the_consumer_tables_hold_the_out_of_order_run_as_the_builder_makes_it(
    out_of_order: Any, tmp_path: Path
) -> None:
    """The same run through the consumer's tables, one envelope per batch and every batch
    delivered twice (a redelivery after each commit): the tables hold each entry once, in
    ``seq`` order, and the headers' statuses are the terminal ones.

    Mutant V5 (the builder's ``notification_id`` not advanced): the tree's row kept
    ``notification_id`` 0 whatever it applied. docs/kafka.md "Commands" and "Tables": each
    batch commits each tree's high-water mark, "last applied position and notification id: the
    processed ids" (``agentfold_transcript_trees.notification_id``)."""
    _, transcripts, envelopes = out_of_order
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        for envelope in envelopes:
            store.apply([envelope])
            again = store.apply([envelope])
            assert (again.applied, again.duplicates, again.entries) == (0, 1, 0)
            # The tree's high-water mark: the last applied position and its notification id.
            (row,) = store._rows("SELECT position, notification_id FROM agentfold_transcript_trees")
            assert (row["position"], row["notification_id"]) == (envelope["position"], envelope["notification_id"])
        assert store.transcripts() == transcripts
    finally:
        store.close()
    assert {t["status"] for t in transcripts.values()} == {"completed", "failed"}


def test_a_refused_delegate_start_and_a_failed_delegate_are_reported_under_their_own_calls() -> None:
    """Mutants T8 (a refused Delegate start's result given at its offset in the batch, not at the
    batch's start plus the offset) and T13 (the same for a Delegate that failed): in a round
    whose Delegate batch does not start at the first call (a call refused before it), the
    results were attached to the wrong calls. The kernel refuses a start only on limits a
    scripted run does not reach, so the round's events are built by hand (the stored bodies'
    shapes: ``test_rejected_starts_failed_delegates_and_validator_feedback_are_reported``).

    docs/kafka.md "Entry kinds": ``tool_result`` "or the Interaction itself (a call it refused, a
    Delegate start refused, a Delegate result)", under the call's ToolCallRef.

    Also mutants U7 (a refused Delegate start made no ``delegate_start`` entry, ``started``
    false with the ``failure``) and U9 (an entry's ``position`` was its notification id: the
    same number in a store with one tree, as in the scripted runs' fixtures that check it):
    ``delegate_start`` is made when "a Delegate call started its child (or the start was
    refused)"; every entry has the ``notification_id``, ``position`` and ``timestamp`` of the
    event that made it."""
    tree, pid = "tree:" + "c" * 32, "process:" + "d" * 32
    calls = [_call("c0", "teleport"), _call("c1", "writer"), _call("c2", "critic")]
    refusal = {"kind": "execution", "code": "engine.limit.children", "message": "no more children"}
    events: list[tuple[str, dict[str, Any]]] = [
        ("TreeStarted", {"input": {"messages": [{"role": "user", "content": "go"}]}}),
        ("EffectDeclared", {"effect_id": "effect:m1", "target": "dispatcher",
                            "payload": {"model_call": {"model_call_sequence": 1, "message_count": 1}}}),
        ("EffectSettled", {"effect_id": "effect:m1", "status": "succeeded", "payload": {"model_result": {"response": {
            "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "", "tool_calls": calls}}}}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "admit_round"},
                                             {"op": "reject", "text": 'error: tool "teleport" is not available'}]}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "start_batch", "kind": "delegate", "size": 2, "request": 2}]}}),
        ("EffectDeclared", {"effect_id": "effect:s2", "target": "framework", "payload": {
            "operation": "start_child", "key": str(delegate_child_key(1, "c2", "critic")), "input": {"topic": "x"}}}),
        ("EffectSettled", {"effect_id": "effect:s2", "status": "failed", "payload": {"failure": refusal}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "record_starts", "rejected": {"1": "error: start refused"}}]}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "record_outcomes", "failed": {"0": "error: writer ended with failed"}},
                                             {"op": "finish_batch"}, {"op": "finish_round"}]}}),
        ("ProcessTerminated", {"status": "canceled", "cause": "host_cancellation", "reason": "stop"}),
    ]
    envelopes = [
        # Notification ids of a log that other trees wrote to first: not the tree's positions.
        {"notification_id": 100 + i, "tree_id": tree, "position": i, "process_id": pid, "type": t,
         "schema_version": 1, "timestamp": "2026-01-01T00:00:00.000000Z", "payload": {"process_id": pid, **p},
         "digest": "sha256:" + "0" * 64}
        for i, (t, p) in enumerate(events, start=1)
    ]
    t = build_transcripts(envelopes)[pid]
    (refused,) = [e for e in t["entries"] if e["kind"] == "delegate_start"]
    assert (refused["tool_call_ref"], refused["tool_call_id"], refused["delegate_name"]) == (f"{pid}/1/2", "c2", "critic")
    assert (refused["started"], refused["child_process_id"], refused["failure"]) == (False, None, refusal)
    # Each entry names the event that made it: its notification id and its position in the tree.
    for entry in t["entries"]:
        assert entry["notification_id"] == 100 + entry["position"]
    assert refused["position"] == 7
    results = [(e["tool_call_ref"], e["tool_name"], e["disposition"], e["text"])
               for e in t["entries"] if e["kind"] == "tool_result"]
    assert results == [
        (f"{pid}/1/0", "teleport", "rejected", 'error: tool "teleport" is not available'),
        (f"{pid}/1/2", "critic", "rejected", "error: start refused"),
        (f"{pid}/1/1", "writer", "failed", "error: writer ended with failed"),
    ]


def test_a_gap_stops_the_consumer_with_its_batch_uncommitted_and_its_offsets_where_they_were(
    out_of_order: Any, tmp_path: Path
) -> None:
    """Mutant T11 (``TranscriptConsumer.poll_once`` committed the offsets of a batch that met a
    gap before raising ``feed.gap``): the consumer stopped as promised, but its group's offsets
    had moved past the batch, so a consumer restarted once the missing record was back on the
    topic never read the batch again and its transcripts kept the hole for good. The only gap
    test of the consumer (tests/test_feed_reconnects.py) needs a broker and reads no offset.

    docs/kafka.md "Commands": an envelope after a missing position stops the consumer with
    ``feed.gap``; "What the consumer verifies": the batch's transaction rolled back and its
    offsets not committed."""
    from agentfold.domain.errors import AgentfoldError
    from tests.feed.support import fake_topic_consumer

    _, transcripts, envelopes = out_of_order
    store, consumer, topic = fake_topic_consumer(tmp_path, max_records=5)
    try:
        topic.write(*envelopes[:5])
        assert consumer.poll_once(0) is not None and topic.commits == 1
        topic.write(*envelopes[6:])  # position 6 is missing
        with pytest.raises(AgentfoldError) as stopped:
            consumer.poll_once(0)
        assert stopped.value.code == "feed.gap"
        assert topic.commits == 1 and store.events_applied() == 5
        # A restart from the committed offset, once the missing record is on the topic again.
        topic.records = topic.records[:5]
        topic.at = 5
        topic.write(*envelopes[5:])
        while consumer.poll_once(0) is not None:
            pass
        assert store.transcripts() == transcripts
    finally:
        consumer.close()
        store.close()


def test_a_humans_answer_is_shown_under_the_call_whose_tool_asked_for_it(tmp_path: Path) -> None:
    """Mutant T17 (``input_answer`` without the ToolCallRef of the call that asked): the answer
    was in the transcript but attached to no call; the trip test checked the prompt's
    ``tool_call_ref`` and the answer's ``wait_id``, not the answer's call.

    docs/kafka.md "Entry kinds": ``input_answer`` has ``tool_call_ref``, ``tool_process_id``,
    ``wait_id``, ``signal_id``, ``answer``."""
    from tests.feed.support import trip_envelopes

    pid, envelopes = trip_envelopes(tmp_path)
    entries = build_transcripts(envelopes)[pid]["entries"]
    (asked,) = [e for e in entries if e["kind"] == "input_prompt"]
    (answered,) = [e for e in entries if e["kind"] == "input_answer"]
    (result,) = [e for e in entries if e["kind"] == "tool_result" and e["tool_name"] == "approve_budget"]
    assert answered["tool_call_ref"] == asked["tool_call_ref"] == result["tool_call_ref"] == f"{pid}/2/0"
    assert answered["tool_process_id"] == asked["tool_process_id"]
    assert (answered["wait_id"], answered["answer"]) == (asked["wait_id"], {"approved": True})


#: A response cut at its token limit with a tool call in it (the call is not run), then an answer.
LENGTH: dict[str, Any] = {
    "name": "trans-length",
    "model": {"responses": [
        {"finish_reason": "length", "message": {"content": "Booking", "tool_calls": [
            _call("c_book", "book_hotel", '{"city": "Lis')]}},
        _final("Sorry, I could not book."),
    ]},
    "tools": [{"name": "book_hotel", "result": {"output": "booked"}}],
}


def test_a_tool_call_cut_at_the_token_limit_gets_its_refused_result(tmp_path: Path) -> None:
    """Mutant T18 (projections ``_definite``: a round opened only for ``finish_reason``
    ``tool_calls``, not ``length``): the Interaction refuses every call of a response cut at
    its token limit (a result the model sees), but the transcript had no ``tool_result`` for
    it: the call stayed without a result although the run went on. No run had a cut response.

    docs/kafka.md "Entry kinds": every tool call of an admitted round gets exactly one
    ``tool_result``; the Interaction's own results (a call it refused) have ``source``
    ``interaction``."""
    runs = _Runs(tmp_path, LENGTH)
    try:
        _, tree = runs.start()
        assert tree.root.status == "completed", tree.root.termination
        t = runs.transcripts()[str(tree.root.process_id)]
    finally:
        runs.close()
    pid = t["process_id"]
    assert _kinds(t) == ["input_message", "assistant_message", "tool_result", "assistant_message", "final_output"]
    said, result = t["entries"][1:3]
    assert said["finish_reason"] == "length" and said["tool_calls"][0]["tool_call_ref"] == f"{pid}/1/0"
    assert (result["tool_call_ref"], result["tool_call_id"], result["tool_name"]) == (f"{pid}/1/0", "c_book", "book_hotel")
    assert (result["source"], result["disposition"]) == ("interaction", "rejected")
    assert "was not executed because model output reached its token limit" in result["text"]


def test_a_following_consumer_reads_a_batch_again_after_its_database_transaction_failed(
    out_of_order: Any, tmp_path: Path
) -> None:
    """Mutant U4 (``TranscriptConsumer.rewind`` did not seek back to the committed offset): after
    a batch whose database transaction failed (rolled back), a following consumer went on from
    the records it had polled, not from its committed offsets; the failed batch was never read
    again and its tree's next batch stopped the consumer on ``feed.gap``, its transcripts cut
    short. Only the broker tests (PostgreSQL and Kafka) took this path.

    docs/kafka.md "Failures while following": the consumer reports the failure, waits, opens a
    new connection and goes back to the committed offsets; nothing is lost, no entry written
    twice. The records come through the consumer's own path from a stand-in for kafka-python's
    consumer (``FakeTopic``) that keeps a committed offset; the failure is the real database
    transaction's, failing before its commit."""
    import sqlite3
    import threading
    from typing import NamedTuple

    from tests.feed.support import FakeTopic

    class Partition(NamedTuple):
        topic: str
        partition: int

    class CommittedTopic(FakeTopic):
        def __init__(self) -> None:
            super().__init__()
            self.committed_at: int | None = None

        def commit(self) -> None:
            super().commit()
            self.committed_at = self.at

        def committed(self, tp: Any) -> int | None:
            return self.committed_at

        def seek(self, tp: Any, offset: int) -> None:
            self.at = offset

        def seek_to_beginning(self, tp: Any) -> None:
            self.at = 0

        def assignment(self) -> set[Any]:
            return {Partition("t", 0)}

    from agentfold.adapters.transcripts import TranscriptConsumer

    _, transcripts, envelopes = out_of_order
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    topic = CommittedTopic()
    topic.write(*envelopes)
    consumer = TranscriptConsumer(store, "unused:1", "t", "g", consumer=topic, max_records=5)
    applied = store.apply
    calls = 0

    def apply_failing_once(batch: Any, **options: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second batch's transaction fails before its commit

            def fail() -> None:
                raise sqlite3.OperationalError("disk I/O error")

            return applied(batch, before_commit=fail, **options)
        return applied(batch, **options)

    store.apply = apply_failing_once  # type: ignore[method-assign]
    stop = threading.Event()
    consumer.on_batch = lambda _report: stop.set() if store.events_applied() == len(envelopes) else None
    lines: list[str] = []
    try:
        report = consumer.follow_until_stopped(stop, lines.append, backoff=0.01, max_backoff=0.01)
        assert store.transcripts() == transcripts
    finally:
        consumer.close()
        store.close()
    assert (report.failures, report.totals.applied, report.totals.duplicates) == (1, len(envelopes), 0)
    assert any("disk I/O error" in line for line in lines), lines
    assert "following again from the committed offsets (t/0 at 5)" in lines
