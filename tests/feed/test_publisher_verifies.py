"""The publisher verifies the digest chain of what it produces (docs/kafka.md).

A stored event changed by hand (its recorded timestamp, as a careless operator or bit rot
would do it) still decodes, but its digest no longer chains. ``publish`` must not put it on
the topic, nor any later event of its tree (a consumer would see a hole), and one damaged
tree must not hold back every other tree's records: it holds back that tree from the damaged
event on (``agentfold_feed_held``), publishes the others, and ``--once`` exits 1 naming the
tree, the position and the rule, as loading the tree does, on every run while the tree is
held. Once the tree is repaired, the next run publishes its held records, in order.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.feed import Publisher, PublisherPosition
from agentfold.adapters.transcripts import transcripts_from_store
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql, append_past_index_row
from tests.feed.support import TopicRead, follow_until, read_topic_confluent, stored_envelopes
from tests.test_cli import agentfold
from tests.test_feed_reconnects import _runs


def _tamper(url: str, tree_id: str, position: int) -> bytes:
    """Change the stored event's recorded timestamp; returns its state as it was."""
    sql = Sql(url)
    version, topic, state = next(r for r in sql.rows(TreeID(tree_id)) if r[0] == position)
    tampered = state.replace(b'"timestamp":"2', b'"timestamp":"1', 1)
    assert tampered != state
    sql.set_row(TreeID(tree_id), version, topic, tampered)
    return state


def _repair(url: str, tree_id: str, position: int, state: bytes) -> None:
    """Put a tampered event's state back (``_tamper`` returned it), as a restore from a backup would."""
    sql = Sql(url)
    sql.set_row(TreeID(tree_id), position, next(r[1] for r in sql.rows(TreeID(tree_id)) if r[0] == position), state)


def _position(url: str, topic: str) -> int:
    store = EventStore(url, create=False)
    try:
        return PublisherPosition(store, topic).get()
    finally:
        store.close()


def _publish_once(url: str, bootstrap: str, topic: str) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    """`publish --once --json`: its exit status, its report and the errors it printed on stderr."""
    ran = agentfold("publish", "--bootstrap", bootstrap, "--topic", topic, "--once", "--batch-size", "7",
                    "--json", store=url)
    errors = [json.loads(line)["error"] for line in ran.stderr.strip().splitlines() if line.startswith("{")]
    return ran.code, json.loads(ran.stdout), errors


def _in_order_per_tree(read: TopicRead) -> dict[str, list[int]]:
    """Each tree's positions as a consumer reads them (partition order); none twice here."""
    positions: dict[str, list[int]] = defaultdict(list)
    for records in read.by_partition().values():
        for r in records:
            positions[r.envelope["tree_id"]].append(r.envelope["position"])
    return positions


def _last_id(url: str) -> int:
    store = EventStore(url, create=False)
    try:
        return store.max_notification_id()
    finally:
        store.close()


def _publish_holds(url: str, bootstrap: str, topic: str, envelopes: list[dict[str, Any]], tree_id: str,
                   held_from: int) -> dict[str, Any]:
    """`publish --once` publishes every event of ``envelopes`` (the store's before the damage)
    but those of ``tree_id`` from ``held_from`` on (once each, each tree in position order),
    stores the log's last notification id as its position, and exits 1 with one store.corrupt
    error naming the tree (returned); a second run publishes nothing more and says the same."""
    last = _last_id(url)
    expected = [e for e in envelopes if not (e["tree_id"] == tree_id and e["position"] >= held_from)]
    code, report, errors = _publish_once(url, bootstrap, topic)
    assert code == 1, (report, errors)
    [error] = errors
    assert error["code"] == "store.corrupt" and error["detail"]["tree_id"] == tree_id
    assert "held back from the topic" in error["message"]
    [held] = report["held_trees"]
    assert (held["tree_id"], held["held_from"], held["code"]) == (tree_id, held_from, "store.corrupt")
    assert report["events"] == len(expected)
    assert report["held_events"] == last - len(expected)  # the tree's events from there on, a forged one too
    read = read_topic_confluent(bootstrap, topic, expected=len(expected))
    assert sorted(read.notification_ids()) == [e["notification_id"] for e in expected]
    for tree, positions in _in_order_per_tree(read).items():
        assert positions == list(range(1, len(positions) + 1)), tree  # no hole, no reordering
    assert _in_order_per_tree(read)[tree_id] == list(range(1, held_from))
    assert _position(url, topic) == last

    again, report2, errors2 = _publish_once(url, bootstrap, topic)
    assert again == 1 and [e["detail"] for e in errors2] == [error["detail"]]
    assert report2["events"] == 0 and report2["held_trees"] == report["held_trees"]
    assert sorted(read_topic_confluent(bootstrap, topic, expected=len(expected)).notification_ids()) == [
        e["notification_id"] for e in expected]
    return error


def test_publish_holds_back_a_tree_whose_digest_does_not_chain_and_publishes_the_others(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    url = durable_store_url
    _runs(url, 4)
    envelopes = stored_envelopes(url)
    # an event in the middle of the log, not the first of its tree
    damaged = next(e for e in envelopes[len(envelopes) // 2 :] if e["position"] > 3)
    _tamper(url, damaged["tree_id"], damaged["position"])

    topic = f"verify-{uuid.uuid4().hex[:8]}"
    error = _publish_holds(url, kafka_bootstrap, topic, envelopes, damaged["tree_id"], damaged["position"])
    assert {k: error["detail"][k] for k in ("tree_id", "position", "rule")} == {
        "tree_id": damaged["tree_id"], "position": damaged["position"], "rule": "integrity.digest_chain"}
    assert "recorded digest sha256:" in error["message"]


def test_publish_holds_back_a_tree_with_an_event_added_past_its_index_row_even_when_it_chains(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    # Found by a regression audit: a forged event appended by hand with a correct digest chain
    # (a steering message) was published, and transcripts showed it as the user's words, while
    # every load refused the tree (index.head_mismatch).
    url = durable_store_url
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[0]["tree_id"]
    forged = append_past_index_row(url, TreeID(tree_id))

    topic = f"anchor-{uuid.uuid4().hex[:8]}"
    error = _publish_holds(url, kafka_bootstrap, topic, envelopes, tree_id, forged)
    assert {k: error["detail"][k] for k in ("tree_id", "position", "rule")} == {
        "tree_id": tree_id, "position": forged, "rule": "index.head_mismatch"}
    assert "events were added past it" in error["message"]


def test_a_held_tree_stays_held_for_new_events_and_is_published_in_order_once_repaired(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    url = durable_store_url
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    damaged = next(e for e in envelopes if e["position"] == 4)
    tree_id = damaged["tree_id"]
    original = _tamper(url, tree_id, 4)
    topic = f"repair-{uuid.uuid4().hex[:8]}"
    _publish_holds(url, kafka_bootstrap, topic, envelopes, tree_id, 4)

    # Runs started after the damage are published; the held tree still is not.
    last = _runs(url, 2)
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and [e["detail"]["tree_id"] for e in errors] == [tree_id]
    assert report["events"] == last - envelopes[-1]["notification_id"] > 0

    # Repaired (the changed row put back): the next run publishes the held records and exits 0.
    _repair(url, tree_id, 4, original)
    ran = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--batch-size", "3",
                    "--json", store=url)
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert "held_trees" not in report
    held_records = [e for e in envelopes if e["tree_id"] == tree_id and e["position"] >= 4]
    assert len(held_records) > 3  # produced in more than one page
    assert report["events"] == report["released_events"] == len(held_records)
    assert report["position"] == report["from_position"]  # older records: the stored position did not move
    assert f"tree {tree_id} verifies again: published its {len(held_records)} held record(s)" in ran.stderr

    everything = stored_envelopes(url)
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(everything))
    assert sorted(read.notification_ids()) == [e["notification_id"] for e in everything]  # once each
    for tree, positions in _in_order_per_tree(read).items():
        assert positions == list(range(1, len(positions) + 1)), tree
    for r in read.records:
        assert r.envelope == next(e for e in everything if e["notification_id"] == r.envelope["notification_id"])

    again = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--json", store=url)
    assert again.code == 0 and json.loads(again.stdout)["events"] == 0, again.stderr


def test_the_report_of_a_run_that_released_a_repaired_tree_names_its_records_not_a_backwards_range(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    # Found by a docs walk: the released records are older than the stored position, and the
    # text said "notification ids 347..346".
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    topic = f"released-{uuid.uuid4().hex[:8]}"
    released = "record(s) of trees held back earlier, released once they verified again"

    def repaired_run(envelopes: list[dict[str, Any]], new_runs: int) -> tuple[int, int, int, str]:
        """Damage the first tree of ``envelopes``, publish (it is held), add ``new_runs`` runs,
        repair it and publish in text: (records held, position before, position after, the report)."""
        tree_id = envelopes[0]["tree_id"]
        original = _tamper(url, tree_id, 4)
        code, _, errors = _publish_once(url, kafka_bootstrap, topic)
        assert code == 1 and [e["detail"]["tree_id"] for e in errors] == [tree_id]
        start = _last_id(url)
        last = _runs(url, new_runs) if new_runs else start
        _repair(url, tree_id, 4, original)
        ran = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", store=url)
        assert ran.code == 0, ran.stderr
        return len([e for e in envelopes if e["tree_id"] == tree_id and e["position"] >= 4]), start, last, ran.stdout

    _runs(url, 2)
    held, _, _, said = repaired_run(stored_envelopes(url), 0)
    assert said.strip() == f"published {held} event(s) from {url} to topic {topic} ({held} {released})"

    # A run that also publishes new events: their range of notification ids, then the released records.
    published = _last_id(url)
    _runs(url, 1)
    held, start, last, said = repaired_run([e for e in stored_envelopes(url) if e["notification_id"] > published], 1)
    assert said.strip() == (f"published {last - start + held} event(s) from {url} to topic {topic} "
                            f"(notification ids {start + 1}..{last}; {held} {released})")


def test_a_publisher_killed_after_producing_a_batch_that_found_a_corrupt_tree_holds_it_when_run_again(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    # The hold is written after the broker acknowledged the batch and before its position: a
    # crash in between leaves neither, so the next run reads the batch again and finds it again.
    url = durable_store_url
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    damaged = next(e for e in envelopes[len(envelopes) // 2 :] if e["position"] > 3)
    _tamper(url, damaged["tree_id"], damaged["position"])
    topic = f"crash-{uuid.uuid4().hex[:8]}"
    died = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--batch-size", "1000",
                     store=url, env={"AGENTFOLD_PUBLISHER_CRASH": "after-produce:1"})
    assert died.code == 75, died.stderr
    assert _position(url, topic) == 0
    assert Sql(url).count("agentfold_feed_held") == 0

    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and [e["detail"]["tree_id"] for e in errors] == [damaged["tree_id"]]
    expected = [e["notification_id"] for e in envelopes
                if not (e["tree_id"] == damaged["tree_id"] and e["position"] >= damaged["position"])]
    assert report["events"] == len(expected)
    read = read_topic_confluent(kafka_bootstrap, topic, expected=2 * len(expected))
    assert sorted(read.notification_ids()) == sorted(expected * 2)  # the killed run's batch came again, once
    assert _position(url, topic) == envelopes[-1]["notification_id"]


def _each_event_once_in_order(read: TopicRead, stored: list[dict[str, Any]]) -> None:
    """The topic holds every stored event once (by tree and position), each tree in position
    order with no hole, each record the stored event."""
    assert sorted((r.envelope["tree_id"], r.envelope["position"]) for r in read.records) == sorted(
        (e["tree_id"], e["position"]) for e in stored)
    for tree, positions in _in_order_per_tree(read).items():
        assert positions == list(range(1, len(positions) + 1)), tree
    by_position = {(e["tree_id"], e["position"]): e for e in stored}
    for r in read.records:
        assert r.envelope["digest"] == by_position[(r.envelope["tree_id"], r.envelope["position"])]["digest"]


def _take_out(url: str, envelopes: list[dict[str, Any]], position: int) -> tuple[str, str, bytes]:
    """Delete the event at ``position`` of a tree in the middle of the log (one that goes on past
    it); returns the tree id and the row's topic and state as stored, to put it back."""
    tree_id = next(e for e in envelopes[len(envelopes) // 2 :] if e["position"] > position + 2)["tree_id"]
    sql = Sql(url)
    _, topic_name, state = next(r for r in sql.raw_rows(TreeID(tree_id)) if r[0] == position)
    sql.delete(TreeID(tree_id), position)
    return tree_id, topic_name, state


def test_an_event_deleted_from_a_tree_is_held_from_there_and_published_in_order_once_restored(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    # Found by a review: the hold started after the missing event, so once it was put back the
    # tree's records went on past a hole (or the restored event came after later ones).
    url = durable_store_url
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id, topic_name, state = _take_out(url, envelopes, 5)
    sql = Sql(url)
    topic = f"deleted-{uuid.uuid4().hex[:8]}"
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and [e["detail"]["tree_id"] for e in errors] == [tree_id]
    [held] = report["held_trees"]
    assert (held["held_from"], held["position"], held["rule"]) == (5, 5, "integrity.missing_event")

    sql.insert(TreeID(tree_id), 5, topic_name, state)  # restored, under a new notification id
    ran = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--json", store=url)
    assert ran.code == 0, ran.stderr
    assert "held record(s) from position 5 on" in ran.stderr
    stored = stored_envelopes(url)
    _each_event_once_in_order(read_topic_confluent(kafka_bootstrap, topic, expected=len(stored)), stored)


def test_a_row_restored_under_a_later_notification_id_is_published_in_its_place(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    # Found by a review: an event deleted and put back (a restore from a backup) before the
    # publisher reached it went out after the tree's later events, a hole then a late record
    # (the transcript consumer stopped on feed.gap), although the store verifies.
    url = durable_store_url
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id, topic_name, state = _take_out(url, envelopes, 10)
    Sql(url).insert(TreeID(tree_id), 10, topic_name, state)
    topic = f"restored-{uuid.uuid4().hex[:8]}"
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 0 and not errors and "held_trees" not in report, errors
    stored = stored_envelopes(url)
    assert report["events"] == len(stored)  # each once: the restored row's own notification is passed over
    _each_event_once_in_order(read_topic_confluent(kafka_bootstrap, topic, expected=len(stored)), stored)


def test_a_published_event_moved_by_hand_holds_its_tree_until_it_is_put_back(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    # Found by a review: with the published event at position 10 moved to position 1000, the
    # hold started at 1001, and the next run released the still damaged tree with nothing
    # published: its records from 11 on never came.
    url = durable_store_url
    _runs(url, 1)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[0]["tree_id"]
    assert [e["position"] for e in envelopes[:10]] == list(range(1, 11))
    topic = f"moved-{uuid.uuid4().hex[:8]}"
    store = EventStore(url)
    try:
        publisher = Publisher(store, kafka_bootstrap, topic, batch_size=10)
        assert publisher.step() == 10  # positions 1-10 published, the rest not yet
        publisher.close()
    finally:
        store.close()
    sql = Sql(url)
    moved = "UPDATE agentfold_events SET originator_version = ? WHERE originator_id = ? AND originator_version = ?"
    sql._run(moved, (1000, sql._id(TreeID(tree_id)), 10))
    for _ in range(2):  # held, and still held on the next run: nothing is released while it is damaged
        code, report, errors = _publish_once(url, kafka_bootstrap, topic)
        assert code == 1 and [e["detail"]["tree_id"] for e in errors] == [tree_id], report
        assert report["held_trees"][0]["held_from"] == 10
    sql._run(moved, (10, sql._id(TreeID(tree_id)), 1000))  # put back
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 0 and not errors
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(envelopes) + 1)  # 10 goes out twice
    assert sorted(set(_in_order_per_tree(read)[tree_id])) == list(range(1, len(envelopes) + 1))
    _each_event_once_in_order(_deduplicated(read), envelopes)


def _deduplicated(read: TopicRead) -> TopicRead:
    """The records a consumer keeps (the first of each notification id)."""
    seen: set[int] = set()
    kept = TopicRead()
    for records in read.by_partition().values():
        for r in records:
            if r.envelope["notification_id"] not in seen:
                seen.add(r.envelope["notification_id"])
                kept.records.append(r)
    return kept


def test_a_partly_repaired_tree_is_published_up_to_its_next_damage_and_held_from_there(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    url = durable_store_url
    _runs(url, 2)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[-1]["tree_id"]
    first, second = _tamper(url, tree_id, 5), _tamper(url, tree_id, 9)
    topic = f"partly-{uuid.uuid4().hex[:8]}"
    code, report, _ = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and report["held_trees"][0]["held_from"] == 5

    sql = Sql(url)
    sql.set_row(TreeID(tree_id), 5, next(r[1] for r in sql.rows(TreeID(tree_id)) if r[0] == 5), first)
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and report["events"] == 4  # positions 5 to 8
    [held] = report["held_trees"]
    assert (held["held_from"], held["position"], held["rule"]) == (9, 9, "integrity.digest_chain")
    assert errors[0]["detail"]["position"] == 9
    expected = [e for e in envelopes if not (e["tree_id"] == tree_id and e["position"] >= 9)]
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(expected))
    assert _in_order_per_tree(read)[tree_id] == list(range(1, 9))

    sql.set_row(TreeID(tree_id), 9, next(r[1] for r in sql.rows(TreeID(tree_id)) if r[0] == 9), second)
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 0 and not errors and "held_trees" not in report
    _each_event_once_in_order(read_topic_confluent(kafka_bootstrap, topic, expected=len(envelopes)), envelopes)


def test_a_stored_row_with_a_null_state_holds_back_its_tree_only(durable_store_url: str, kafka_bootstrap: str) -> None:
    # It stopped the publisher with cli.internal (TypeError), before and after the holds.
    url = durable_store_url
    _runs(url, 2)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[-1]["tree_id"]
    Sql(url)._run("UPDATE agentfold_events SET state = NULL WHERE originator_id = ? AND originator_version = 7",
                  (Sql(url)._id(TreeID(tree_id)),))
    topic = f"null-{uuid.uuid4().hex[:8]}"
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and [(e["code"], e["detail"]["rule"]) for e in errors] == [("store.corrupt", "integrity.format")]
    assert report["held_trees"][0]["held_from"] == 7
    assert report["events"] == len([e for e in envelopes if not (e["tree_id"] == tree_id and e["position"] >= 7)])


def test_an_index_row_whose_version_is_not_a_number_holds_back_its_tree_only(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    # SQLite keeps what a hand edit writes; it stopped the publisher with cli.internal (ValueError).
    url = f"sqlite:///{tmp_path / 'index.db'}"
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[-1]["tree_id"]
    Sql(url)._run("UPDATE agentfold_trees SET version = 'x' WHERE tree_id = ?", (tree_id,))
    topic = f"index-{uuid.uuid4().hex[:8]}"
    code, report, errors = _publish_once(url, kafka_bootstrap, topic)
    assert code == 1 and [(e["detail"]["tree_id"], e["detail"]["rule"]) for e in errors] == [
        (tree_id, "index.head_mismatch")]
    assert "version is not a number" in errors[0]["message"]
    assert report["events"] == len([e for e in envelopes if e["tree_id"] != tree_id])


def test_a_row_that_names_no_tree_stops_the_publisher_after_what_came_before_it(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    # There is no tree to hold back (SQLite keeps originator_id as text; PostgreSQL's is a uuid):
    # it stopped with cli.internal (ValueError from eventsourcing's read) and published nothing.
    url = f"sqlite:///{tmp_path / 'nameless.db'}"
    _runs(url, 2)
    envelopes = stored_envelopes(url)
    bad = envelopes[len(envelopes) // 2]["notification_id"]
    Sql(url)._run("UPDATE agentfold_events SET originator_id = 'not-a-tree' WHERE rowid = ?", (bad,))
    topic = f"nameless-{uuid.uuid4().hex[:8]}"
    ran = agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once", "--batch-size", "1000",
                    "--json", store=url)
    assert ran.code == 1
    [line] = ran.stderr.strip().splitlines()
    error = json.loads(line)["error"]
    assert error["code"] == "store.corrupt" and f"notification {bad} names no tree" in error["message"]
    before = [e["notification_id"] for e in envelopes if e["notification_id"] < bad]
    assert sorted(read_topic_confluent(kafka_bootstrap, topic, expected=len(before)).notification_ids()) == before
    assert _position(url, topic) == bad - 1


def test_a_following_publisher_whose_position_write_reply_is_lost_goes_on_holding_the_tree(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    # Found by a review: the hold was taken into memory only after the position write; when the
    # reply to that write was lost, the retry went on from the stored position without it and
    # published the held tree's later records past the damaged one.
    url = f"sqlite:///{tmp_path / 'lost.db'}"
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id = envelopes[-1]["tree_id"]
    _tamper(url, tree_id, 10)
    damaged = next(e["notification_id"] for e in envelopes if e["tree_id"] == tree_id and e["position"] == 10)
    store = EventStore(url)
    topic = f"lost-{uuid.uuid4().hex[:8]}"
    said: list[str] = []
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=20, on_held=lambda h: said.append(h.tree_id))
    save = publisher._position.save
    lost: list[int] = []

    def save_losing_a_reply(notification_id: int) -> None:
        save(notification_id)
        if not lost and notification_id >= damaged:
            lost.append(notification_id)
            raise sqlite3.OperationalError("the reply to the position write was lost")

    publisher._position.save = save_losing_a_reply  # type: ignore[method-assign]
    lines = follow_until(publisher, lambda: publisher.position >= envelopes[-1]["notification_id"] and bool(lost))
    assert any("following again from position" in line for line in lines)
    assert said == [tree_id] and list(publisher.held) == [tree_id]
    expected = [e for e in envelopes if not (e["tree_id"] == tree_id and e["position"] >= 10)]
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(expected))
    assert _in_order_per_tree(read)[tree_id] == list(range(1, 10))  # nothing past the damaged event
    assert set(read.notification_ids()) == {e["notification_id"] for e in expected}


def test_transcripts_from_the_store_refuse_a_forged_event_as_the_publisher_does(durable_store_url: str) -> None:
    # Found by a review: transcripts_from_store read the notification log without the
    # publisher's checks, so a forged steering message became a user's transcript entry.
    url = durable_store_url
    _runs(url, 2)
    tree_id = stored_envelopes(url)[0]["tree_id"]
    store = EventStore(url, create=False)
    try:
        whole = transcripts_from_store(store)
        assert whole  # an honest store: transcripts as before
        forged = append_past_index_row(url, TreeID(tree_id))
        with pytest.raises(CorruptStream) as refused:
            transcripts_from_store(store)
        assert (refused.value.tree_id, refused.value.position, refused.value.rule) == (
            TreeID(tree_id), forged, "index.head_mismatch"
        )
        _tamper(url, tree_id, 3)  # and a changed event: its chain breaks first
        with pytest.raises(CorruptStream) as changed:
            transcripts_from_store(store)
        assert (changed.value.position, changed.value.rule) == (3, "integrity.digest_chain")
    finally:
        store.close()
