"""Stored rows edited by hand into NULL columns are damage agentfold names, on both backends
(found by a review of the event store): a NULL topic or state made loads, `show`, `audit
verify` and store-wide commands fail with a bare AttributeError/TypeError (`cli.internal`), and
on PostgreSQL one NULL state stopped `pending`, `recover` and `audit verify --all` for every
tree (the library converts each state with bytes()), where SQLite reported the one tree."""

from __future__ import annotations

import pytest

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.feed import store_envelopes
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql, record_chain
from tests.test_cli import agentfold

LAST = 15  # record_chain's three effects: 15 events


def two_trees_one_damaged(url: str, column: str) -> tuple[TreeID, TreeID, str]:
    """Two recorded chains; the last event of the first edited to a NULL ``column``: the damaged
    tree, the intact one, and the rule that names the damage."""
    bad = record_chain(url, start_id="null-bad")
    good = record_chain(url, start_id="null-good")
    sql = Sql(url)
    sql._run(f"UPDATE agentfold_events SET {column} = NULL WHERE originator_id = ? AND originator_version = ?",
             (sql._id(bad), LAST))
    return bad, good, "stream.event_type" if column == "topic" else "integrity.format"


@pytest.mark.parametrize("column", ["topic", "state"])
def test_a_null_column_in_an_event_is_a_corrupt_tree_the_other_trees_unaffected(
    durable_store_url: str, column: str
) -> None:
    url = durable_store_url
    bad, good, rule = two_trees_one_damaged(url, column)
    store = EventStore(url)
    try:
        with pytest.raises(CorruptStream) as corrupt:
            store.load(bad)
        assert (corrupt.value.position, corrupt.value.rule) == (LAST, rule)
        assert store.load(good).state.version == LAST
    finally:
        store.close()
    shown = agentfold("show", str(bad), "--json", store=url)
    assert shown.code == 1 and shown.error()["code"] == "store.corrupt", shown.stderr
    verified = agentfold("audit", "verify", "--all", "--json", store=url)
    assert verified.code == 1, verified.stderr
    results = {r["tree"]: r for r in verified.json()["results"]}
    assert results[str(good)]["ok"] is True
    (problem,) = results[str(bad)]["problems"]
    assert (problem["position"], problem["rule"]) == (LAST, rule)
    assert agentfold("trees", "--json", store=url).code == 0


def test_a_null_snapshot_state_is_skipped_by_loads_and_reported_by_verify(durable_store_url: str) -> None:
    url = durable_store_url
    tree_id = record_chain(url, start_id="null-snapshot")
    store = EventStore(url)
    try:
        loaded = store.load(tree_id)
        store.write_snapshot(tree_id, loaded.state.version, store.encode_snapshot(loaded.state, loaded.digest))
        Sql(url)._run("UPDATE agentfold_snapshots SET state = NULL")
        assert store.load(tree_id).state.version == LAST  # folded from the first event
    finally:
        store.close()
    verified = agentfold("audit", "verify", str(tree_id), "--json", store=url)
    assert verified.code == 1, verified.stderr
    (problem,) = verified.json()["results"][0]["problems"]
    assert (problem["position"], problem["rule"]) == (LAST, "snapshot.mismatch")
    assert "malformed" in problem["detail"]


@pytest.mark.parametrize("column", ["topic", "state"])
def test_a_null_column_is_named_by_the_readers_of_the_notification_log(durable_store_url: str, column: str) -> None:
    # The notification log (read-model follower, `project`, serve's follower, the feed's readers)
    # went through the library's select_notifications, which calls bytes() on each state: on
    # PostgreSQL `project` failed with cli.internal (serve's follower would restart for ever,
    # stuck for every tree), and store_envelopes raised a bare TypeError; a NULL topic made
    # store_envelopes raise a bare AttributeError on both backends.
    url = durable_store_url
    bad, good, rule = two_trees_one_damaged(url, column)
    projected = agentfold("project", "--json", store=url)
    assert projected.code == 1, projected.stderr
    (corrupt,) = projected.json()["corrupt_trees"]
    assert (corrupt["tree_id"], corrupt["position"], corrupt["rule"]) == (str(bad), LAST, rule)
    assert projected.json()["position"] == 2 * LAST  # the whole log was read: the good tree too
    assert str(good) not in projected.stdout  # only the damaged tree is named
    store = EventStore(url)
    try:
        with pytest.raises(CorruptStream) as found:
            for _ in store_envelopes(store):
                pass
        assert (found.value.tree_id, found.value.position, found.value.rule) == (bad, LAST, rule)
    finally:
        store.close()
