"""Stored states: sealed JSON, deflated when that pays (docs/events.md "Stored record format").

A user observes: large events take less room in the events table, small ones stay readable
JSON, stores written before compression existed still load, and damaged compressed bytes
are an integrity error at their position, never a crash or a silently different event.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import (
    COMPRESS_MIN_BYTES,
    COMPRESSED,
    MAX_STATE_BYTES,
    SMALL_STATE_BYTES,
    STATE_COMPRESSOR,
    stored_json,
)
from agentfold.adapters.eventstore import SNAPSHOT_FORMAT, CorruptStream, EventStore, LoadedTree
from agentfold.adapters.runtime import index_head
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import SealError
from agentfold.domain.tree import TreeState, fold_tree
from tests.test_fold_rules import TREE, one_effect, settled

TIMESTAMP = "2026-01-01T00:00:00.000000Z"


def test_small_and_incompressible_states_stay_json_and_large_ones_deflate() -> None:
    small = b'{"digest":"sha256:' + b"0" * 64 + b'","event":{},"timestamp":"x"}'
    assert len(small) < COMPRESS_MIN_BYTES and STATE_COMPRESSOR.compress(small) == small
    noise = b'{"x":"' + os.urandom(600).hex().encode() + b'"}'  # hex of random bytes: deflates to ~55%
    packed = STATE_COMPRESSOR.compress(noise)
    assert packed[:1] == COMPRESSED and len(packed) < len(noise)
    assert stored_json(packed) == noise
    random_bytes = b"{" + os.urandom(4000)  # nothing to gain: kept as is
    assert STATE_COMPRESSOR.compress(random_bytes) == random_bytes
    big = b'{"x":"' + b"abc" * 200_000 + b'"}'  # a large state gets a large window
    assert stored_json(STATE_COMPRESSOR.compress(big)) == big


@pytest.mark.parametrize("size", [COMPRESS_MIN_BYTES, 1000, SMALL_STATE_BYTES - 1, SMALL_STATE_BYTES, SMALL_STATE_BYTES + 1, 70_000])
def test_states_on_both_sides_of_the_small_table_size_deflate_and_read_back(size: int) -> None:
    # States up to SMALL_STATE_BYTES deflate with small tables, larger ones with zlib's
    # default: both must read back exactly, and both must actually be deflated.
    text = b" ".join(b"word%d" % (i % 97) for i in range(size))
    state = (b'{"x":"' + text)[: size - 2] + b'"}'
    assert len(state) == size
    packed = STATE_COMPRESSOR.compress(state)
    assert packed[:1] == COMPRESSED and len(packed) < size // 2
    assert stored_json(packed) == state


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (COMPRESSED + b"\xff\xff\xff", "does not inflate"),
        (STATE_COMPRESSOR.compress(b'{"a":"' + b"x" * 1000 + b'"}')[:-4], "truncated"),
        (STATE_COMPRESSOR.compress(b'{"a":"' + b"x" * 1000 + b'"}') + b"junk", "extra bytes"),
    ],
)
def test_damaged_compressed_states_are_refused(state: bytes, why: str) -> None:
    with pytest.raises(SealError):
        stored_json(state)


def test_a_compressed_state_cannot_inflate_beyond_the_bound() -> None:
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = COMPRESSED + deflate.compress(b"{" + b" " * (MAX_STATE_BYTES + 10)) + deflate.flush()
    assert len(bomb) < 100_000
    with pytest.raises(SealError, match="too large"):
        stored_json(bomb)


def _raw_store(tmp_path: Path) -> EventStore:
    store = EventStore(f"sqlite:///{tmp_path / 'c.db'}")
    events = one_effect()
    events[4] = settled(1, payload={"text": "a fairly repetitive result " * 40})
    head = index_head(fold_tree(events), TREE, events, TIMESTAMP)  # as the runtime writes it
    store.append(TREE, 0, events, previous_digest=None, timestamp=TIMESTAMP, head=head)
    return store


def test_the_store_writes_large_states_deflated_and_reads_them_back(tmp_path: Path) -> None:
    store = _raw_store(tmp_path)
    raw = store.read_raw(TREE)
    settlement = raw[4]
    assert settlement.state[:1] == COMPRESSED
    assert len(settlement.state) < len(stored_json(settlement.state)) // 3
    assert store.load(TREE).state.version == len(raw)


def test_a_history_stored_as_plain_json_still_loads(tmp_path: Path) -> None:
    """Stores written before compression (or by an import of plain JSON) hold JSON states."""
    store = _raw_store(tmp_path)
    plain = [
        StoredEvent(s.originator_id, s.originator_version, s.topic, stored_json(s.state)) for s in store.read_raw(TREE)
    ]
    other = EventStore(f"sqlite:///{tmp_path / 'plain.db'}")
    other.recorder.insert_events(plain, head=store.head(TREE))  # an import writes the index row too
    assert all(s.state[:1] == b"{" for s in other.read_raw(TREE))
    assert other.load(TREE).state.to_json() == store.load(TREE).state.to_json()


def test_a_damaged_compressed_state_is_an_integrity_error_at_its_position(tmp_path: Path) -> None:
    store = _raw_store(tmp_path)
    raw = store.read_raw(TREE)
    damaged = [
        StoredEvent(s.originator_id, s.originator_version, s.topic, s.state[:-2] if i == 4 else s.state)
        for i, s in enumerate(raw)
    ]
    other = EventStore(f"sqlite:///{tmp_path / 'damaged.db'}")
    other.recorder.insert_events(damaged)
    with pytest.raises(CorruptStream) as caught:
        other.load(TREE)
    assert (caught.value.position, caught.value.rule) == (5, "integrity.format")


def snapshotted(url: str, start_id: str) -> tuple[EventStore, TreeID, Catalog, LoadedTree, StoredEvent]:
    """A finished Interaction tree with one snapshot of its whole history in the store at ``url``:
    the store, the tree, its catalog, the tree folded without the snapshot, and the snapshot's row."""
    from tests.test_output_stored_once import run_interaction

    store = EventStore(url)
    tree_id, catalog = run_interaction(store, start_id)
    plain = store.load(tree_id, catalog.resolve, use_snapshot=False)
    assert plain.digest is not None
    store.save_snapshot(tree_id, plain.state, plain.digest)
    (row,) = store.snapshots.select_events(tree_id.uuid)
    return store, tree_id, catalog, plain, row


def test_snapshots_are_stored_deflated_and_older_json_snapshots_still_load(durable_store_url: str) -> None:
    store, tree_id, catalog, plain, row = snapshotted(durable_store_url, "snap-1")
    assert plain.digest is not None
    body = EventStore.encode_snapshot(plain.state, plain.digest)
    assert row.state[:1] == COMPRESSED and len(row.state) < len(body)
    loaded = store.load(tree_id, catalog.resolve)
    assert loaded.snapshot_version == plain.state.version
    assert loaded.state.to_json() == plain.state.to_json()

    # A snapshot row as an earlier release wrote it (plain JSON) loads the same.
    store.snapshots.prune(tree_id.uuid, plain.state.version + 1)
    store.snapshots.insert_events([StoredEvent(tree_id.uuid, plain.state.version, row.topic, body)])
    again = store.load(tree_id, catalog.resolve)
    assert again.snapshot_version == plain.state.version and again.state.to_json() == plain.state.to_json()
    store.close()


def edited_under_its_digest(plain: LoadedTree) -> bytes:
    """A current snapshot whose tree was edited, its digest and seal left as they were (a
    tamper audit made a finished tool call look unfinished this way: it was called again)."""
    assert plain.digest is not None
    body = json.loads(EventStore.encode_snapshot(plain.state, plain.digest))
    body["tree"]["processes"][-1]["committed_steps"] += 1
    return json.dumps(body).encode()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong shape", "another digest", "edited under its digest"])
def test_a_damaged_snapshot_is_skipped_and_the_tree_folds_from_its_events(
    durable_store_url: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A snapshot is a cache: a damaged row must not make a healthy history unreadable
    # (SQLite BLOB and PostgreSQL BYTEA rows alike).
    store, tree_id, catalog, plain, row = snapshotted(durable_store_url, "snap-2")
    bad = {
        "garbage": b"\x00not a snapshot",
        "truncated": row.state[: len(row.state) // 2],
        "wrong shape": b'{"tree": {"version": "x"}, "digest": 1}',
        # readable, but not this history's: the next append would chain to a wrong digest
        "another digest": EventStore.encode_snapshot(plain.state, "sha256:" + "0" * 64),
        "edited under its digest": edited_under_its_digest(plain),
    }[damage]
    store.snapshots.prune(tree_id.uuid, plain.state.version + 1)
    store.snapshots.insert_events([StoredEvent(tree_id.uuid, plain.state.version, row.topic, bad)])
    with caplog.at_level("WARNING", logger="agentfold.store"):
        loaded = store.load(tree_id, catalog.resolve)
    assert loaded.snapshot_version == 0
    assert loaded.state.to_json() == plain.state.to_json() and loaded.digest == plain.digest
    reason = {
        "another digest": "does not match the event stored there",
        "edited under its digest": "is not the one sealed with its digest",
    }.get(damage, "unreadable")
    assert any("snapshot of tree" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    store.close()


def test_a_snapshot_row_moved_to_an_earlier_version_is_not_used_for_an_earlier_end(
    durable_store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by a store review: the seal binds a snapshot's tree to its digest, not to the row's
    # version, so a row moved by hand to an earlier version was taken by `load(upto=)` for an
    # end past that version, and the load returned a tree later than `upto` (replay --at,
    # verify's re-fold at a position) with the digest of an event after it.
    store, tree_id, catalog, plain, row = snapshotted(durable_store_url, "snap-moved")
    end = plain.state.version
    upto = end - 3
    expected = store.load(tree_id, catalog.resolve, use_snapshot=False, upto=upto)
    store.snapshots.prune(tree_id.uuid, end + 1)
    store.snapshots.insert_events([StoredEvent(tree_id.uuid, upto - 2, row.topic, row.state)])
    with caplog.at_level("WARNING", logger="agentfold.store"):
        loaded = store.load(tree_id, catalog.resolve, upto=upto)
    assert loaded.state.version == upto and loaded.snapshot_version == 0
    assert loaded.state.to_json() == expected.state.to_json() and loaded.digest == expected.digest
    assert any("snapshot of tree" in r.getMessage() and "moved after it was written" in r.getMessage()
               for r in caplog.records)
    whole = store.load(tree_id, catalog.resolve)
    assert whole.state.to_json() == plain.state.to_json() and whole.digest == plain.digest
    store.close()


def before_mailbox_compaction(snapshot: dict[str, object]) -> dict[str, object]:
    """``snapshot`` as releases before mailbox compaction wrote it: no ``format`` member, no
    ``arrivals``/``consumed_through`` counters, the cursor counting every consumed record
    (they kept them all). Read back as if it were current, its state is not the fold's."""
    tree = json.loads(json.dumps(snapshot["tree"]))
    for process in tree["processes"]:
        mailbox = process["mailbox"]
        mailbox["cursor"] = mailbox.pop("arrivals")
        del mailbox["consumed_through"]
    return {"tree": tree, "digest": snapshot["digest"]}


@pytest.mark.parametrize("written_as", ["before mailbox compaction", "a later format", "a format that is no number"])
def test_a_snapshot_in_another_format_is_not_used_and_audit_skips_it(
    durable_store_url: str, written_as: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by an upgrade audit: snapshots written before mailbox compaction were read back
    # with made-up counters, so a load gave another state than folding the events (`show`
    # differed, `audit verify` failed a sound history, and the runtime's next snapshots carried
    # the difference forward).
    from agentfold.adapters.audit import verify_tree

    store, tree_id, catalog, plain, row = snapshotted(durable_store_url, "snap-format")
    assert plain.digest is not None
    current = json.loads(EventStore.encode_snapshot(plain.state, plain.digest))
    assert current["format"] == SNAPSHOT_FORMAT
    body = {
        "before mailbox compaction": before_mailbox_compaction(current),
        "a later format": {**current, "format": SNAPSHOT_FORMAT + 1},
        "a format that is no number": {**current, "format": str(SNAPSHOT_FORMAT)},
    }[written_as]
    if written_as == "before mailbox compaction":  # read back as if current, it would mislead
        misread = TreeState.from_json(body["tree"], catalog.resolve)  # type: ignore[arg-type]
        assert misread.to_json() != plain.state.to_json()
    store.snapshots.prune(tree_id.uuid, plain.state.version + 1)
    store.snapshots.insert_events([StoredEvent(tree_id.uuid, plain.state.version, row.topic,
                                               json.dumps(body).encode())])
    with caplog.at_level("INFO", logger="agentfold.store"):
        loaded = store.load(tree_id, catalog.resolve)
    assert loaded.snapshot_version == 0  # folded from the first event
    assert loaded.state.to_json() == plain.state.to_json() and loaded.digest == plain.digest
    assert any("snapshot of tree" in r.getMessage() and "is not used" in r.getMessage() for r in caplog.records)
    check, _, _ = verify_tree(store, tree_id, catalog)
    if written_as == "a format that is no number":  # not another release's: a malformed row
        assert [(p.rule, "its format is not a number" in p.detail) for p in check.problems] == [
            ("snapshot.mismatch", True)]
    else:
        assert check.problems == []
    # The current format is used as before.
    store.snapshots.prune(tree_id.uuid, plain.state.version + 1)
    store.save_snapshot(tree_id, loaded.state, plain.digest)
    assert store.load(tree_id, catalog.resolve).snapshot_version == plain.state.version
    store.close()
