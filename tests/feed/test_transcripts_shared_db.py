"""Several transcript consumers writing one database (docs/kafka.md, "Tables": "Several consumer
groups may share a database only if they read the same topic"; and the members of one group,
while a partition changes owner, re-read what the database already holds).

Found by a review: on PostgreSQL, two consumers applying a new tree's first records at once
both inserted its first positions: the row lock (``SELECT ... FOR UPDATE``) that serializes
them on a known tree locks nothing for a tree that has no row yet. The second failed with
psycopg's ``UniqueViolation`` on ``agentfold_transcript_digests``, neither classified nor
retried: the consumer stopped with ``cli.internal``. Now the second waits for the first and
skips its records as duplicates, as on a known tree.

Two ``TranscriptStore`` objects on one real PostgreSQL database stand for the two consumers
(what each applies is what ``TranscriptConsumer.poll_once`` hands it); the first is held just
before its COMMIT (``before_commit``) while the second applies.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentfold.adapters.transcripts import DIGESTS, ApplyReport, TranscriptStore
from agentfold.domain.errors import AgentfoldError
from agentfold.projections.transcripts import build_transcripts
from tests.feed.support import two_tree_envelopes


@pytest.fixture(scope="module")
def two_trees(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """The envelopes of two runs' trees, each tree's in position order."""
    trees = two_tree_envelopes(tmp_path_factory.mktemp("shared-db"))
    assert len(trees) >= 2 and all(len(t) >= 10 for t in trees[:2])
    return trees[:2]


def _overlap(url: str, first: list[dict[str, Any]], second: list[dict[str, Any]],
             known: list[dict[str, Any]] | None = None) -> tuple[ApplyReport, ApplyReport, float]:
    """``first`` applied by one store, held before its COMMIT, while another applies ``second``;
    ``known`` applied before both. Returns both reports and how long the second one had waited
    when the first was let go (it is let go after 1 s, or once the second returned)."""
    a, b = TranscriptStore(url), TranscriptStore(url)
    try:
        if known:
            a.apply(known)
        held, go = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            assert go.wait(30)

        result: dict[str, Any] = {}
        first_member = threading.Thread(target=lambda: result.update(a=a.apply(first, before_commit=hold)))
        first_member.start()
        assert held.wait(30)

        def second_member() -> None:
            try:
                result["b"] = b.apply(second)
            except Exception as exc:  # noqa: BLE001 - shown by the assertion below
                result["error"] = exc

        other = threading.Thread(target=second_member)
        started = time.monotonic()
        other.start()
        other.join(1.0)
        waited = time.monotonic() - started
        go.set()
        first_member.join(30)
        other.join(30)
        assert "error" not in result, repr(result.get("error"))
        return result["a"], result["b"], waited
    finally:
        a.close()
        b.close()


def test_a_second_consumer_waits_for_a_new_trees_first_records_and_skips_them_as_duplicates(
    two_trees: list[list[dict[str, Any]]], pg_database: str,
) -> None:
    """The review's reproducer: the same batch of a new tree's positions 1-10, twice at once."""
    batch = two_trees[0][:10]
    first, second, waited = _overlap(pg_database, batch, batch)
    assert waited >= 1.0  # it did wait for the first transaction
    assert (first.applied, first.duplicates) == (10, 0)
    assert (second.applied, second.duplicates) == (0, 10)
    store = TranscriptStore(pg_database)
    try:
        assert store.tree_positions() == {batch[0]["tree_id"]: 10}
        assert store.transcripts() == build_transcripts(batch)
    finally:
        store.close()


def test_a_second_consumer_with_two_new_trees_in_the_other_order_applies_its_own_and_skips_the_shared_one(
    two_trees: list[list[dict[str, Any]]], pg_database: str,
) -> None:
    """The second batch holds the shared new tree after a tree only it has, also new: it waits
    for the shared one, then applies its own tree and skips the shared one's records."""
    shared, own = two_trees[0][:10], two_trees[1][:6]
    first, second, waited = _overlap(pg_database, shared, own + shared)
    assert waited >= 1.0
    assert (first.applied, second.applied, second.duplicates) == (10, 6, 10)
    store = TranscriptStore(pg_database)
    try:
        assert store.tree_positions() == {shared[0]["tree_id"]: 10, own[0]["tree_id"]: 6}
        assert store.transcripts() == build_transcripts(shared + own)
    finally:
        store.close()


def test_a_second_consumer_on_a_known_tree_still_waits_and_skips_the_records(
    two_trees: list[list[dict[str, Any]]], pg_database: str,
) -> None:
    """What already worked: the tree has a row (positions 1-3 applied before)."""
    tree = two_trees[0]
    first, second, waited = _overlap(pg_database, tree[:10], tree[:10], known=tree[:3])
    assert waited >= 1.0
    assert (first.applied, first.duplicates, second.applied, second.duplicates) == (7, 3, 0, 10)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_unique_key_the_tables_already_hold_is_a_classified_error_with_nothing_committed(
    two_trees: list[list[dict[str, Any]]], backend: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """Tables that contradict themselves (a digest row left for a position its tree's row does
    not reach: rows deleted by hand) refuse the batch's insert on every try: that is
    ``store.append_failed`` naming the database and how to rebuild, never the driver's
    ``IntegrityError`` / ``UniqueViolation`` (``cli.internal``)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'transcripts.db'}"
    else:
        from tests.conftest import fresh_pg_database

        url = fresh_pg_database(request)
    batch = two_trees[0][:5]
    store = TranscriptStore(url)
    try:
        with store._transaction() as c:  # what a hand-made partial cleanup leaves
            c.execute(store._sql(f"INSERT INTO {DIGESTS} (tree_id, position, notification_id, digest) VALUES (?,?,?,?)"),
                      (batch[2]["tree_id"], 3, 999, batch[2]["digest"]))
        with pytest.raises(AgentfoldError) as refused:
            store.apply(batch)
        assert refused.value.code == "store.append_failed", refused.value
        assert "refused a write 3 times" in refused.value.message and "reset()" in (refused.value.hint or "")
        assert isinstance(refused.value.__cause__, sqlite3.IntegrityError | psycopg.errors.UniqueViolation)
        assert store.tree_positions() == {}
    finally:
        store.close()
