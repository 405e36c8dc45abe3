"""The transcript builder without a broker: envelopes made from a real store's notification log.

These prove what the transcripts say (entry kinds, order, ToolCallRefs), that the builder
is incremental and restartable from its JSON state, that duplicates are skipped and gaps
refused, and that the consumer's tables (SQLite, PostgreSQL) hold exactly what the pure
builder makes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import envelope_bytes, store_envelopes
from agentfold.adapters.transcripts import TranscriptStore, transcripts_from_store
from agentfold.domain.json_schema import schema_errors
from agentfold.projections.transcripts import (
    EnvelopeInvalid,
    SchemaVersionUnsupported,
    TranscriptGap,
    TreeTranscripts,
    build_transcripts,
    check_envelope,
)
from tests.feed.support import ROOT, documented_envelope_schema, verify_chain
from tests.feed.workload import Run, Workload


@pytest.fixture(scope="module")
def runs_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Run]]:
    """A SQLite store with two runs of each cycled shape plus a model-unknown and a failing run."""
    url = f"sqlite:///{tmp_path_factory.mktemp('feed-pure') / 'store.db'}"
    store = EventStore(url)
    workload = Workload(store)
    try:
        runs = {f"{run.shape}-{i}": run for i, run in enumerate(workload.runs(6))}
        runs["model_unknown"] = workload.run(6, "model_unknown")
        runs["failing"] = workload.run(7, "failing")
    finally:
        workload.close()
        store.close()
    return url, runs


def _envelopes(url: str) -> list[dict[str, Any]]:
    store = EventStore(url)
    try:
        return list(store_envelopes(store))
    finally:
        store.close()


def _kinds(transcript: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in transcript["entries"]]


def test_every_envelope_matches_the_documented_schema_and_carries_the_stored_body(runs_store: Any) -> None:
    url, _ = runs_store
    envelopes = _envelopes(url)
    schema = documented_envelope_schema()
    for e in envelopes:
        assert schema_errors(e, schema) == [], e
        check_envelope(e)
        # Canonical bytes: a consumer in any language sees sorted keys and no whitespace.
        assert envelope_bytes(e) == orjson.dumps(json.loads(envelope_bytes(e)), option=orjson.OPT_SORT_KEYS)
    assert verify_chain(envelopes) == 8
    assert [e["notification_id"] for e in envelopes] == list(range(1, len(envelopes) + 1))


def test_a_trip_transcript_has_input_tools_prompt_steering_answer_and_final_answer(runs_store: Any) -> None:
    url, runs = runs_store
    transcripts = build_transcripts(_envelopes(url))
    run = runs["trip-0"]
    t = transcripts[run.root_process_id]
    assert _kinds(t) == [
        "input_message", "input_message", "assistant_message", "tool_result", "tool_result", "assistant_message",
        "input_prompt", "steering", "input_answer", "tool_result", "assistant_message", "final_output",
    ]
    e = t["entries"]
    pid = run.root_process_id
    assert [m["role"] for m in e[:2]] == ["system", "user"] and e[1]["text"] == "request 0: trip"
    assert [c["tool_call_ref"] for c in e[2]["tool_calls"]] == [f"{pid}/1/0", f"{pid}/1/1"]
    assert [c["name"] for c in e[2]["tool_calls"]] == ["weather", "book_hotel"]
    assert (e[3]["tool_call_ref"], e[3]["tool_name"], e[3]["disposition"], e[3]["text"]) == (
        f"{pid}/1/0", "weather", "succeeded", "sunny, 24 C")
    assert e[4]["output"] == {"details": {"confirmation": "H-1042", "hotel": "Hotel Alfama"}}
    assert e[6]["prompt"] == {"question": "Approve 420 EUR?"} and e[6]["tool_call_ref"] == f"{pid}/2/0"
    assert e[6]["response_schema"]["required"] == ["approved"]
    assert e[7]["signal_id"] == "steer-0" and e[7]["text"] == "note 0: window seat please"
    assert e[8]["wait_id"] == e[6]["wait_id"] and e[8]["answer"] == {"approved": True}
    assert e[10]["applied_steer_signal_ids"] == ["steer-0"] and e[10]["model_call_sequence"] == 3
    assert e[11]["text"].startswith("Trip planned") and t["status"] == "completed"
    assert [x["seq"] for x in e] == list(range(1, 13)) and t["entry_count"] == 12
    positions = [x["position"] for x in e]
    assert positions == sorted(positions)


def test_a_delegate_run_reports_the_refused_call_the_child_transcript_and_the_failed_tool(runs_store: Any) -> None:
    url, runs = runs_store
    transcripts = build_transcripts(_envelopes(url))
    run = runs["delegate-1"]
    pid = run.root_process_id
    t = transcripts[pid]
    assert _kinds(t) == [
        "input_message", "input_message", "assistant_message", "tool_result", "delegate_start", "delegate_result",
        "tool_result", "tool_result", "assistant_message", "final_output",
    ]
    e = t["entries"]
    assert (e[3]["tool_name"], e[3]["source"], e[3]["disposition"]) == ("teleport", "interaction", "rejected")
    assert e[3]["text"] == 'error: tool "teleport" is not available'
    child = e[4]["child_process_id"]
    assert (e[4]["delegate_name"], e[4]["tool_call_ref"], e[4]["started"]) == ("writer", f"{pid}/1/1", True)
    assert e[5]["status"] == "completed" and e[5]["child_process_id"] == child
    assert (e[6]["tool_call_ref"], e[6]["source"], e[6]["output"]) == (
        f"{pid}/1/1", "delegate", {"details": e[5]["output"]})
    assert (e[7]["tool_name"], e[7]["disposition"], e[7]["text"]) == ("lookup", "failed", "lookup service is down")
    # The Delegate child is an Interaction too, with its own transcript naming the call.
    c = transcripts[child]
    assert (c["parent_process_id"], c["tool_call_ref"]) == (pid, f"{pid}/1/1")
    assert _kinds(c) == ["input_message", "assistant_message", "final_output"]
    assert c["entries"][0]["text"] == '{"topic": "Lisbon"}'


def test_unknown_outcomes_and_their_resolutions_appear_where_they_happened(runs_store: Any) -> None:
    url, runs = runs_store
    transcripts = build_transcripts(_envelopes(url))
    t = transcripts[runs["unknown-2"].root_process_id]
    assert _kinds(t) == [
        "input_message", "input_message", "assistant_message", "unknown_outcome", "steering", "unknown_resolved",
        "tool_result", "assistant_message", "final_output",
    ]
    unknown, resolved = t["entries"][3], t["entries"][5]
    assert unknown["effect_kind"] == "tool" and unknown["diagnostic"]["code"] == "engine.dispatch.failed"
    assert unknown["tool_call_ref"] == resolved["tool_call_ref"] == t["entries"][6]["tool_call_ref"]
    assert (resolved["status"], resolved["resolved_by"]) == ("succeeded", "host")
    assert t["entries"][6]["output"] == {"details": {"charged": True, "reference": "C-7"}}

    m = transcripts[runs["model_unknown"].root_process_id]
    assert _kinds(m) == [
        "input_message", "input_message", "unknown_outcome", "unknown_resolved", "assistant_message", "final_output",
    ]
    assert m["entries"][2]["effect_kind"] == "model" and m["entries"][2]["model_call_sequence"] == 1
    assert m["entries"][4]["text"] == "Recovered answer."

    f = transcripts[runs["failing"].root_process_id]
    assert _kinds(f) == ["input_message", "input_message", "assistant_message", "failure"]
    assert f["status"] == "failed"
    assert f["entries"][-1]["failure"]["code"] == "interaction.model.tool_calls_not_completed"


def test_every_tool_call_gets_exactly_one_result(runs_store: Any) -> None:
    url, _ = runs_store
    for t in build_transcripts(_envelopes(url)).values():
        if t["status"] != "completed":
            continue
        calls = [c["tool_call_ref"] for e in t["entries"] if e["kind"] == "assistant_message" for c in e["tool_calls"]]
        results = [e["tool_call_ref"] for e in t["entries"] if e["kind"] == "tool_result"]
        assert sorted(results) == sorted(calls)


def test_building_one_envelope_at_a_time_from_stored_json_state_gives_the_same_transcripts(runs_store: Any) -> None:
    url, _ = runs_store
    envelopes = _envelopes(url)
    expected = build_transcripts(envelopes)
    states: dict[str, Any] = {}
    entries: dict[str, list[dict[str, Any]]] = {}
    for e in envelopes:
        # Every envelope on a builder rebuilt from JSON bytes: what a restarted consumer does.
        builder = TreeTranscripts(e["tree_id"], orjson.loads(orjson.dumps(states[e["tree_id"]])) if e["tree_id"] in states else None)
        for entry in builder.apply(e) or ():
            entries.setdefault(entry["process_id"], []).append(entry)
        states[e["tree_id"]] = builder.to_json()
    assert {pid: t["entries"] for pid, t in expected.items()} == entries


def test_duplicates_are_skipped_and_tree_interleaving_does_not_matter(runs_store: Any) -> None:
    url, _ = runs_store
    envelopes = _envelopes(url)
    expected = build_transcripts(envelopes)
    # Re-send windows (as after a publisher crash), then shuffle trees while keeping each tree's order.
    with_duplicates = envelopes[:100] + envelopes[40:100] + envelopes[100:] + envelopes[-30:]
    by_tree: dict[str, list[dict[str, Any]]] = {}
    for e in with_duplicates:
        by_tree.setdefault(e["tree_id"], []).append(e)
    rng = random.Random(7)
    queues = list(by_tree.values())
    mixed = []
    while queues:
        q = rng.choice(queues)
        mixed.append(q.pop(0))
        if not q:
            queues.remove(q)
    assert build_transcripts(mixed) == expected


def test_a_missing_position_is_refused_not_skipped(runs_store: Any) -> None:
    url, _ = runs_store
    envelopes = [e for e in _envelopes(url) if e["tree_id"] == _envelopes(url)[0]["tree_id"]]
    builder = TreeTranscripts(envelopes[0]["tree_id"])
    for e in envelopes[:10]:
        builder.apply(e)
    with pytest.raises(TranscriptGap) as gap:
        builder.apply(envelopes[11])
    assert (gap.value.expected, gap.value.got) == (11, 12)
    assert builder.position == 10  # nothing of the refused envelope was applied


def test_envelopes_without_the_documented_members_are_refused(runs_store: Any) -> None:
    url, _ = runs_store
    good = _envelopes(url)[0]
    for broken in (
        {k: v for k, v in good.items() if k != "digest"},
        {**good, "extra": 1},
        {**good, "position": "1"},
        {**good, "type": "Nonsense", "tree_id": "order-1"},  # not of the schema whatever its type
        {**good, "type": "Nonsense", "payload": []},
        {**good, "payload": []},
    ):
        with pytest.raises(EnvelopeInvalid):
            check_envelope(broken)
        assert schema_errors(broken, documented_envelope_schema()) != []
    # An envelope of the schema but for its event type: an event of a later release, a stop.
    with pytest.raises(SchemaVersionUnsupported) as stopped:
        check_envelope({**good, "type": "Nonsense"})
    assert stopped.value.unknown_type and not isinstance(stopped.value, EnvelopeInvalid)


def test_an_unknown_schema_version_stops_the_builder_instead_of_being_skipped(runs_store: Any) -> None:
    url, _ = runs_store
    envelopes = _envelopes(url)
    builder = TreeTranscripts(envelopes[0]["tree_id"])
    builder.apply(envelopes[0])
    with pytest.raises(SchemaVersionUnsupported) as refused:
        builder.apply({**envelopes[1], "schema_version": 2})
    assert refused.value.code == "feed.schema_version_unsupported"
    assert not isinstance(refused.value, EnvelopeInvalid)  # not set aside like a malformed record
    assert builder.position == 1


def test_rejected_starts_failed_delegates_and_validator_feedback_are_reported() -> None:
    """Hand-built envelopes for the round paths the scripted runs do not take."""
    tree, pid = "tree:" + "a" * 32, "process:" + "b" * 32
    calls = [{"id": "c0", "name": "writer", "arguments": "{}"}, {"id": "c1", "name": "critic", "arguments": "{}"}]
    events: list[tuple[str, dict[str, Any]]] = [
        ("TreeStarted", {"input": {"messages": [{"role": "user", "content": "go"}]}}),
        ("EffectDeclared", {"effect_id": "effect:m1", "target": "dispatcher",
                            "payload": {"model_call": {"model_call_sequence": 1, "message_count": 1}}}),
        ("EffectSettled", {"effect_id": "effect:m1", "status": "succeeded", "payload": {"model_result": {"response": {
            "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "", "tool_calls": calls}}}}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "admit_round"}]}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "start_batch", "kind": "delegate", "size": 2, "request": 2}]}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "record_starts", "rejected": {"1": "error: start refused"}}]}}),
        ("StepCommitted", {"facts": {"ops": [{"op": "record_outcomes", "failed": {"0": "error: child ended with canceled"}},
                                             {"op": "finish_batch"}, {"op": "finish_round"},
                                             {"op": "user", "text": "cite your sources"}]}}),
        ("ProcessTerminated", {"status": "canceled", "cause": "host_cancellation", "reason": "stop"}),
    ]
    envelopes = [
        {"notification_id": i, "tree_id": tree, "position": i, "process_id": pid, "type": t,
         "schema_version": 1, "timestamp": "2026-01-01T00:00:00.000000Z", "payload": {"process_id": pid, **p},
         "digest": "sha256:" + "0" * 64}
        for i, (t, p) in enumerate(events, start=1)
    ]
    t = build_transcripts(envelopes)[pid]
    assert _kinds(t) == ["input_message", "assistant_message", "tool_result", "tool_result", "feedback", "failure"]
    rejected, failed = t["entries"][2], t["entries"][3]
    assert (rejected["tool_call_ref"], rejected["disposition"], rejected["text"]) == (
        f"{pid}/1/1", "rejected", "error: start refused")
    assert (failed["tool_call_ref"], failed["disposition"], failed["tool_name"]) == (f"{pid}/1/0", "failed", "writer")
    assert t["entries"][4]["text"] == "cite your sources"
    assert (t["status"], t["entries"][5]["cause"]) == ("canceled", "host_cancellation")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_transcript_tables_hold_what_the_builder_makes_and_ignore_a_replay(
    runs_store: Any, backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, runs = runs_store
    db = f"sqlite:///{tmp_path / 'transcripts.db'}" if backend == "sqlite" else request.getfixturevalue("pg_database")
    envelopes = _envelopes(url)
    store = TranscriptStore(db)
    try:
        first = store.apply(envelopes[:150])
        second = store.apply(envelopes[100:])  # 50 envelopes again
        again = store.apply(envelopes)  # everything again
        assert (first.applied, second.applied, second.duplicates) == (150, len(envelopes) - 150, 50)
        assert (again.applied, again.duplicates, again.entries) == (0, len(envelopes), 0)
        event_store = EventStore(url)
        try:
            assert store.transcripts() == transcripts_from_store(event_store)
        finally:
            event_store.close()
        assert store.events_applied() == len(envelopes)
        trip = runs["trip-0"].root_process_id
        assert store.transcript(trip) == build_transcripts(envelopes)[trip]
        assert store.transcript("process:" + "0" * 32) is None
    finally:
        store.close()


def test_agentfold_transcript_prints_one_transcript(runs_store: Any, tmp_path: Path) -> None:
    url, runs = runs_store
    db = f"sqlite:///{tmp_path / 'transcripts.db'}"
    store = TranscriptStore(db)
    try:
        store.apply(_envelopes(url))
    finally:
        store.close()
    pid = runs["trip-0"].root_process_id
    agentfold = [sys.executable, "-m", "agentfold.adapters.cli"]
    shown = subprocess.run([*agentfold, "transcript", pid, "--db", db, "--json"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == build_transcripts(_envelopes(url))[pid]
    text = subprocess.run([*agentfold, "transcript", pid, "--db", db], cwd=ROOT, capture_output=True, text=True)
    assert "[steering] note 0: window seat please" in text.stdout and "[input asked]" in text.stdout
    missing = subprocess.run([*agentfold, "transcript", "process:nope", "--db", db], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "transcripts.not_found" in missing.stderr


def test_agentfold_transcript_reads_and_creates_nothing_on_a_mistyped_db(tmp_path: Path, pg_database: str) -> None:
    """``transcript`` is a read: a --db without the transcript tables is transcripts.not_found
    (exit 2) and is left as it was: no file, no directory, no tables."""
    agentfold = [sys.executable, "-m", "agentfold.adapters.cli"]

    def refused(db: str) -> str:
        ran = subprocess.run([*agentfold, "transcript", "process:nope", "--db", db, "--json"], cwd=ROOT,
                             capture_output=True, text=True)
        assert ran.returncode == 2, ran.stderr
        error = json.loads(ran.stderr)["error"]
        assert error["code"] == "transcripts.not_found" and "agentfold transcripts" in error["hint"]
        return str(error["message"])

    assert "the file does not exist" in refused(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    assert not (tmp_path / "no").exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    assert "no transcript tables" in refused(f"sqlite:///{empty}")
    assert empty.stat().st_size == 0
    assert "no transcript tables" in refused(pg_database)
    import psycopg

    with psycopg.connect(pg_database) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'agentfold_transcript%'").fetchone() == (0,)


def test_transcripts_refuses_an_idle_exit_that_is_not_a_positive_number(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    for value in ("-2", "0", "nan", "1e300"):  # 1e300: beyond what a wait can take
        ran = subprocess.run([sys.executable, "-m", "agentfold.adapters.cli", "transcripts", "--bootstrap", "127.0.0.1:1",
                              "--topic", "t", "--group", "g", "--db", f"sqlite:///{db}", "--idle-exit", value],
                             cwd=ROOT, capture_output=True, text=True)
        assert ran.returncode == 2 and "cli.usage: argument --idle-exit" in ran.stderr, ran.stderr
    assert not db.exists()


def test_an_assistant_reply_without_text_says_so_in_the_printed_transcript() -> None:
    from agentfold.adapters.cli_feed import transcript_text

    call = {"name": "weather", "arguments": '{"city": "Lisbon"}', "tool_call_ref": "process:p/1/0"}
    entries = [
        {"seq": 1, "kind": "assistant_message", "model_call_sequence": 1, "text": "", "tool_calls": [call]},
        {"seq": 2, "kind": "assistant_message", "model_call_sequence": 2, "text": "", "tool_calls": []},
        {"seq": 3, "kind": "assistant_message", "model_call_sequence": 3, "text": "Sunny.", "tool_calls": []},
    ]
    text = transcript_text({"process_id": "process:p", "tree_id": "tree:t", "status": "completed",
                            "entry_count": 3, "entries": entries})
    assert text.splitlines()[1:] == [
        "  1 [assistant #1] (no text, only tool calls)",
        '      -> weather({"city": "Lisbon"})  process:p/1/0',
        "  2 [assistant #2] (no text)",
        "  3 [assistant #3] Sunny.",
    ]


def test_a_canceled_interaction_reports_the_end_of_each_open_tool_call(tmp_path: Path) -> None:
    """Canceled while one call's outcome is unknown and another waits for a human: the
    Interaction ends first (its `failure` entry), its Tool children after it. Each call still
    gets its one `tool_result` (canceled, with the unknown Effect named), which also closes
    the open input prompt."""
    scenario = {
        "name": "canceled-mid-round",
        "limits": {"max_concurrent_tool_calls": 2},
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "c1", "name": "charge", "arguments": "{}"},
                {"id": "c2", "name": "approve", "arguments": "{}"},
            ]}},
            {"finish_reason": "stop", "message": {"content": "done"}},
        ]},
        "tools": [
            {"name": "charge", "result": {"error": "gateway timed out"},
             "concurrency": {"key": "charge", "concurrent": True}},
            {"name": "approve", "result": {"input": {"prompt": "ok?", "response_schema": {"type": "boolean"}},
                                           "then": {"answer": True}},
             "concurrency": {"key": "approve", "concurrent": True}},
        ],
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    url = f"sqlite:///{tmp_path / 'canceled.db'}"
    agentfold = [sys.executable, "-m", "agentfold.adapters.cli", "--store", url, "--json"]
    started = subprocess.run([*agentfold, "run", str(path), "--start-id", "canceled-mid-round"],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    root = json.loads(started.stdout)["root_process_id"]
    canceled = subprocess.run([*agentfold, "cancel", root], capture_output=True, text=True, timeout=120)
    assert canceled.returncode == 0, canceled.stderr
    store = EventStore(url)
    try:
        transcript = transcripts_from_store(store)[root]
        unknown = [e for p in store.load(store.find_tree(root)).state.processes.values() for e in p.unknown_effects()]
    finally:
        store.close()
    assert transcript["status"] == "canceled"
    kinds = _kinds(transcript)
    assert "input_prompt" in kinds and "unknown_outcome" in kinds, kinds
    results = {e["tool_name"]: e for e in transcript["entries"] if e["kind"] == "tool_result"}
    assert sorted(results) == ["approve", "charge"], kinds
    for entry in results.values():
        assert (entry["status"], entry["cause"], entry["disposition"]) == ("canceled", "parent_cancellation", None)
    assert results["charge"]["unresolved_effect_ids"] == [str(e.effect_id) for e in unknown]
    assert "unresolved_effect_ids" not in results["approve"]
    calls = [c["tool_call_ref"] for e in transcript["entries"] if e["kind"] == "assistant_message" for c in e["tool_calls"]]
    assert sorted(e["tool_call_ref"] for e in results.values()) == sorted(calls)


def test_the_consumer_knows_every_event_type_the_store_writes() -> None:
    # An event type of the store's own release missing here would stop that release's consumer
    # ("an event of a later release": feed.schema_version_unsupported) at the first such event.
    from agentfold.domain.events import EVENT_TYPES as STORED_TYPES
    from agentfold.projections.transcripts import EVENT_TYPES as CONSUMED_TYPES

    assert set(CONSUMED_TYPES) == set(STORED_TYPES)
