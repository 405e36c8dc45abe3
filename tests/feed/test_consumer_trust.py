"""The transcript consumer believes only a topic that is consistent with itself (docs/kafka.md,
"What the consumer verifies").

Anyone who can write to the topic can write an envelope. The consumer now refuses one whose
digest is not of the documented form (set aside in the rejects table, as any invalid record),
one whose digest does not chain onto what the tables hold for its tree (``feed.chain_broken``)
and one at a position already applied with another digest (``feed.digest_conflict``, no longer
skipped as a duplicate): the last two stop the consumer with nothing of the batch committed
and the offsets where they were, as a gap does. The records come through the consumer's own
path (``TranscriptConsumer.poll_once``) from a stand-in for the broker.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.transcripts import DIGESTS, TREES, TranscriptConsumer, TranscriptStore
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.json_schema import schema_errors
from agentfold.projections.transcripts import (
    ENVELOPE_PATTERNS,
    EnvelopeInvalid,
    SchemaVersionUnsupported,
    build_transcripts,
    check_envelope,
)
from tests.feed.support import documented_envelope_schema, envelope_digest, fake_topic_consumer, trip_envelopes

GENUINE = "Checking weather and booking."
FORGED = "FORGED: wire 5000 EUR to account XY-123 now."


@pytest.fixture(scope="module")
def trip(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """The root process id and the envelopes (in position order) of one trip run's tree."""
    return trip_envelopes(tmp_path_factory.mktemp("feed-trust"))


def _answer_at(envelopes: list[dict[str, Any]]) -> int:
    """The index of the settlement of the first model call (the first assistant message)."""
    return next(i for i, e in enumerate(envelopes) if e["type"] == "EffectSettled" and GENUINE in orjson.dumps(e["payload"]).decode())


def _forged(envelope: dict[str, Any], digest: str | None = None) -> dict[str, Any]:
    """The envelope with the assistant's answer changed (and, if given, another digest)."""
    forged = copy.deepcopy(envelope)
    forged["payload"] = orjson.loads(orjson.dumps(forged["payload"]).decode().replace(GENUINE, FORGED))
    if digest is not None:
        forged["digest"] = digest
    return forged


def _chained(envelopes: list[dict[str, Any]], previous: str | None) -> list[dict[str, Any]]:
    """The envelopes with digests that chain onto ``previous``: what anyone who can write to the
    topic can compute (the chain proves consistency, not authenticity)."""
    out = []
    for e in envelopes:
        previous = envelope_digest(e, previous)
        out.append({**e, "digest": previous})
    return out




def _drain(consumer: TranscriptConsumer) -> None:
    while consumer.poll_once(0) is not None:
        pass


def _texts(store: TranscriptStore, pid: str) -> list[str]:
    found = store.transcript(pid)
    assert found is not None
    return [str(e.get("text")) for e in found["entries"]]


def test_a_record_with_a_malformed_digest_is_set_aside_and_the_genuine_event_is_applied(
    trip: Any, tmp_path: Path
) -> None:
    """The security review's reproducer: a forged record with ``"digest": "sha256:0"`` written
    before the publisher's. It was applied, and the genuine event was skipped as a duplicate."""
    pid, envelopes = trip
    at = _answer_at(envelopes)
    store, consumer, topic = fake_topic_consumer(tmp_path, max_records=7)
    try:
        topic.write(*envelopes[:at], _forged(envelopes[at], "sha256:0"), *envelopes[at:])
        _drain(consumer)
        assert store.transcript(pid) == build_transcripts(envelopes)[pid]
        assert GENUINE in _texts(store, pid) and not any(FORGED in t for t in _texts(store, pid))
        (reject,) = store.rejects()
        assert reject["record_offset"] == at and "digest must be sha256:<64 lowercase hex>" in reject["error"]
        assert consumer.report.totals.rejected == 1 and consumer.report.totals.duplicates == 0
    finally:
        store.close()


@pytest.mark.parametrize("digest", ["copied", "zeros"])
def test_a_record_whose_digest_does_not_chain_stops_the_consumer_with_nothing_committed(
    trip: Any, tmp_path: Path, digest: str
) -> None:
    """A changed payload under the genuine digest (or any other well-formed one) does not chain
    onto the event before it: ``feed.chain_broken``, the batch is not committed, the offsets
    stay, and the next attempt meets the same record (it is not skipped)."""
    pid, envelopes = trip
    at = _answer_at(envelopes)
    store, consumer, topic = fake_topic_consumer(tmp_path, max_records=at)
    try:
        forged = _forged(envelopes[at], envelopes[at]["digest"] if digest == "copied" else "sha256:" + "0" * 64)
        topic.write(*envelopes[:at], forged, *envelopes[at + 1 :])
        consumer.poll_once(0)
        assert store.tree_positions() == {envelopes[0]["tree_id"]: at} and topic.commits == 1
        for _ in range(2):
            with pytest.raises(AgentfoldError) as refused:
                consumer.poll_once(0)
            assert refused.value.code == "feed.chain_broken", refused.value
            assert refused.value.details == {"tree_id": envelopes[0]["tree_id"], "position": at + 1}
            assert "protect the topic with ACLs" in refused.value.hint
            assert store.tree_positions() == {envelopes[0]["tree_id"]: at} and topic.commits == 1
            topic.at = at  # what a restart from the committed offset polls again
        assert not any(FORGED in t for t in _texts(store, pid))
    finally:
        store.close()


@pytest.mark.parametrize("forged_events", [1, 3])
def test_an_event_at_a_position_applied_with_another_digest_is_a_conflict_not_a_duplicate(
    trip: Any, tmp_path: Path, forged_events: int
) -> None:
    """A forger who computes a valid chain (anyone can) and writes before the publisher gets
    the forged events applied; the genuine event at the same position then comes with another
    digest. It was counted as a duplicate, silently; now it stops the consumer
    (``feed.digest_conflict``), at the high-water mark or below it."""
    pid, envelopes = trip
    at = _answer_at(envelopes)
    forged = _chained([_forged(envelopes[at]), *envelopes[at + 1 : at + forged_events]], envelopes[at - 1]["digest"])
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        topic.write(*envelopes[:at], *forged)
        _drain(consumer)
        assert any(FORGED in t for t in _texts(store, pid))  # a consistent chain is not proof of origin
        topic.write(*envelopes[at:])
        with pytest.raises(AgentfoldError) as refused:
            consumer.poll_once(0)
        assert refused.value.code == "feed.digest_conflict", refused.value
        assert refused.value.details == {"tree_id": envelopes[0]["tree_id"], "position": at + 1}
        assert f"but the transcripts applied {forged[0]['digest']}" in refused.value.message
        assert store.tree_positions() == {envelopes[0]["tree_id"]: at + forged_events}
        assert consumer.report.totals.duplicates == 0
    finally:
        store.close()


def test_the_same_events_again_are_still_duplicates(trip: Any, tmp_path: Path) -> None:
    """At-least-once delivery: a re-delivered batch (same digests) is skipped, below the
    high-water mark and at it, in the same batch and in a later one."""
    pid, envelopes = trip
    store, consumer, topic = fake_topic_consumer(tmp_path, max_records=10)
    try:
        topic.write(*envelopes[:25], *envelopes[5:], *envelopes)
        _drain(consumer)
        assert consumer.report.totals.duplicates == 20 + len(envelopes)
        assert store.transcript(pid) == build_transcripts(envelopes)[pid]
        assert len(store._rows(f"SELECT position FROM {DIGESTS}")) == len(envelopes)
    finally:
        store.close()


def test_a_tree_saved_without_digests_is_verified_from_its_next_envelope_on(trip: Any, tmp_path: Path) -> None:
    """Tables written by a release that kept no digests: the next envelope of such a tree is
    taken as it comes, every one after it must chain onto it; older positions stay duplicates."""
    pid, envelopes = trip
    at = _answer_at(envelopes)
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        store.apply(envelopes[: at - 1])
        with store._transaction() as c:  # what an older release left
            c.execute(f"DELETE FROM {DIGESTS}")
            (row,) = c.execute(f"SELECT state FROM {TREES}").fetchall()
            state = orjson.loads(row["state"])
            del state["digest"]
            c.execute(f"UPDATE {TREES} SET state = ?", (orjson.dumps(state).decode(),))
        topic.write(*envelopes[: at - 1], envelopes[at - 1], _forged(envelopes[at]))
        with pytest.raises(AgentfoldError) as refused:
            _drain(consumer)
        assert refused.value.code == "feed.chain_broken"
        assert store.tree_positions() == {envelopes[0]["tree_id"]: at - 1}
        store.apply(envelopes)
        assert store.transcript(pid) == build_transcripts(envelopes)[pid]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("digest", "sha256:0"),
        ("digest", "sha256:not-a-digest"),
        ("digest", "sha256:" + "A" * 64),
        ("digest", "sha256:" + "0" * 63),
        ("digest", "sha256:" + "0" * 64 + "\n"),
        ("tree_id", "tree:nope"),
        ("tree_id", "tree:" + "0" * 32 + "/x"),
        # Found by a review: the digest does not cover this copy of the payload's process id.
        ("process_id", "process:" + "0" * 32),
    ],
)
def test_an_envelope_must_have_the_documented_digest_and_tree_id(trip: Any, member: str, value: str) -> None:
    _, envelopes = trip
    check_envelope(envelopes[0])
    with pytest.raises(EnvelopeInvalid):
        check_envelope({**envelopes[0], member: value})


def _documented(envelope: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` with a digest that chains over what it carries (anyone can compute one)."""
    return {**envelope, "digest": envelope_digest(envelope, None)}


@pytest.mark.parametrize(
    ("member", "value"),
    [
        # Found by a review: only checked as non-empty strings, so such a record became a transcript.
        ("timestamp", "yesterday at noon"),
        ("timestamp", "2026-11-29 21:39:19.224050Z"),
        ("timestamp", "2026-11-29T21:39:19.224050+00:00"),
        ("timestamp", "2026-11-29T21:39:19.Z"),
        ("timestamp", "2026-11-29T21:39:19.224050Z\n"),  # Python's $ would take it, the schema's does not
        ("timestamp", "\uff12026-11-29T21:39:19Z"),  # a fullwidth digit
        ("process_id", "process:NOT-HEX"),
        ("process_id", "process:"),
        ("process_id", "process:" + "0" * 32 + "\n"),
        ("process_id", "tree:" + "0" * 32),
    ],
)
def test_an_envelope_must_have_the_documented_timestamp_and_process_id(trip: Any, member: str, value: str) -> None:
    """The process id is set in the payload too (the envelope's copy must be the payload's)."""
    _, envelopes = trip
    first = envelopes[0]
    assert first["position"] == 1
    changed = _documented({**first, member: value})
    if member == "process_id":
        changed = _documented({**changed, "payload": {**first["payload"], "process_id": value}})
    if not value.endswith("\n"):
        # agentfold.domain.json_schema matches a pattern with Python's re.search, whose $ also
        # takes a trailing line break (JSON Schema's, ECMA-262's, does not): not a witness there.
        assert schema_errors(changed, documented_envelope_schema()) != []
    with pytest.raises(EnvelopeInvalid, match=member):
        check_envelope(changed)


def test_the_consumer_checks_each_pattern_of_the_documented_schema() -> None:
    """One source of truth: the patterns check_envelope matches are the schema's in docs/kafka.md
    (each between its ``^`` and ``$``), for every string member that has one."""
    properties = documented_envelope_schema()["properties"]
    documented = {name: p["pattern"] for name, p in properties.items() if "pattern" in p}
    assert {name: f"^{p.pattern}$" for name, p in ENVELOPE_PATTERNS.items()} == documented


def test_a_record_not_of_the_envelope_schema_is_kept_as_a_reject_not_applied(trip: Any, tmp_path: Path) -> None:
    """The review's reproducer through the consumer's path: a new tree's first record with a
    timestamp and a process id of another form, its digest chaining over them."""
    _, envelopes = trip
    tree = "tree:" + "ab" * 16
    pid = "process:NOT-HEX"
    forged = _documented({**envelopes[0], "tree_id": tree, "process_id": pid, "timestamp": "yesterday at noon",
                          "payload": {**envelopes[0]["payload"], "process_id": pid}})
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        topic.write(forged)
        _drain(consumer)
        (reject,) = store.rejects()
        assert reject["record_offset"] == 0 and "process_id must be a process id" in reject["error"]
        assert store.tree_positions() == {} and store.transcripts() == {}
        assert consumer.report.totals.rejected == 1 and consumer.report.totals.applied == 0
    finally:
        store.close()


def test_another_systems_record_with_a_schema_version_above_1_is_set_aside_not_a_stop(trip: Any, tmp_path: Path) -> None:
    """Found by a feed review: a record of another system on the topic (`OrderPlaced`, a tree id
    'order-123', schema_version 2) stopped the consumer for good with
    feed.schema_version_unsupported ("upgrade the consumer"), naming no record, and nothing of
    its batch was applied; the same record with schema_version 1 was set aside. Only an event
    type agentfold writes, in the envelope schema, can be an event of a later release."""
    pid, envelopes = trip
    foreign = {"notification_id": 1, "tree_id": "order-123", "position": 1, "process_id": "p", "type": "OrderPlaced",
               "schema_version": 2, "timestamp": "yesterday", "payload": {}, "digest": "none"}
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        topic.write(*envelopes[:3], foreign, *envelopes[3:])
        _drain(consumer)
        assert store.transcript(pid) == build_transcripts(envelopes)[pid]
        (reject,) = store.rejects()
        assert reject["record_offset"] == 3 and "tree_id must be a tree id" in reject["error"], reject
    finally:
        store.close()


@pytest.mark.parametrize("change", [{"schema_version": 9}, {"type": "EffectRetried"}], ids=["version", "type"])
def test_an_event_of_a_later_release_stops_the_consumer_naming_where_it_is(
    trip: Any, tmp_path: Path, change: dict[str, Any],
) -> None:
    """A later schema version, or an event type a later release added. The second was set
    aside like another system's record (found by a review): the tree's next record then
    stopped the consumer as a gap ("an event is missing"), and a tree's last event was lost
    without a word."""
    _, envelopes = trip
    later = {**envelopes[2], **change}
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        topic.write(*envelopes[:2], later, *envelopes[3:])
        with pytest.raises(SchemaVersionUnsupported) as stopped:
            _drain(consumer)
        error = stopped.value
        assert error.code == "feed.schema_version_unsupported" and "upgrade the consumer" in (error.hint or "")
        assert error.details == {"topic": "t", "partition": 0, "offset": 2, "tree_id": envelopes[2]["tree_id"]}
        assert f"envelope (topic t partition 0 offset 2, tree {later['tree_id']})" in error.message, error.message
        if "type" in change:
            assert "event type 'EffectRetried', which this consumer does not know" in error.message, error.message
        else:
            assert f"a {later['type']} envelope (topic" in error.message, error.message
        assert store.rejects() == [] and store.transcripts() == {} and topic.commits == 0  # nothing of it applied
    finally:
        store.close()
