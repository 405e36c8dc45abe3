"""The publisher verifies the digest chain of what it produces (docs/kafka.md).

A stored event changed by hand (its recorded timestamp, as a careless operator or bit rot
would do it) still decodes, but its digest no longer chains. ``publish`` must not put it on
the topic: it publishes every event before it, stores that position, and stops with
``store.corrupt`` naming the tree, the position and the rule, as loading the tree does. A
publisher that starts after the damaged event's predecessors were published (a cold cache:
the previous digest is read from the store) stops on it the same way.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.feed import PublisherPosition
from agentfold.adapters.transcripts import transcripts_from_store
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql, append_past_index_row
from tests.feed.support import read_topic_confluent, stored_envelopes
from tests.test_cli import agentfold
from tests.test_feed_reconnects import _runs


def _tamper(url: str, tree_id: str, position: int) -> None:
    sql = Sql(url)
    version, topic, state = next(r for r in sql.rows(TreeID(tree_id)) if r[0] == position)
    tampered = state.replace(b'"timestamp":"2', b'"timestamp":"1', 1)
    assert tampered != state
    sql.set_row(TreeID(tree_id), version, topic, tampered)


def _position(url: str, topic: str) -> int:
    store = EventStore(url, create=False)
    try:
        return PublisherPosition(store, topic).get()
    finally:
        store.close()


def _publish_stops(url: str, bootstrap: str, topic: str, before: list[int]) -> dict[str, Any]:
    """`publish --once` exits 1 with store.corrupt (its error is returned) after publishing exactly
    the events ``before`` (once each) and storing the last one's position; a publisher started
    from there (nothing of the tree remembered) stops on the same event again."""
    ran = agentfold("publish", "--bootstrap", bootstrap, "--topic", topic, "--once", "--batch-size", "1000",
                    "--json", store=url)
    assert ran.code == 1, ran.stderr
    [line] = ran.stderr.strip().splitlines()
    error: dict[str, Any] = json.loads(line)["error"]
    assert error["code"] == "store.corrupt"
    assert sorted(read_topic_confluent(bootstrap, topic, expected=len(before)).notification_ids()) == before
    assert _position(url, topic) == before[-1]
    again = agentfold("publish", "--bootstrap", bootstrap, "--topic", topic, "--once", "--json", store=url)
    assert again.code == 1 and json.loads(again.stderr)["error"]["detail"] == error["detail"]
    assert _position(url, topic) == before[-1]
    return error


def test_publish_stops_on_an_event_whose_digest_does_not_chain_after_publishing_what_came_before(
    durable_store_url: str, kafka_bootstrap: str,
) -> None:
    url = durable_store_url
    _runs(url, 4)
    envelopes = stored_envelopes(url)
    # an event in the middle of the log, not the first of its tree
    damaged = next(e for e in envelopes[len(envelopes) // 2 :] if e["position"] > 3)
    _tamper(url, damaged["tree_id"], damaged["position"])
    before = [e["notification_id"] for e in envelopes if e["notification_id"] < damaged["notification_id"]]

    topic = f"verify-{uuid.uuid4().hex[:8]}"
    error = _publish_stops(url, kafka_bootstrap, topic, before)
    assert error["detail"] == {"tree_id": damaged["tree_id"], "position": damaged["position"],
                               "rule": "integrity.digest_chain"}
    assert "recorded digest sha256:" in error["message"]


def test_publish_stops_on_an_event_added_past_its_trees_index_row_even_when_it_chains(
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
    before = [e["notification_id"] for e in envelopes]

    topic = f"anchor-{uuid.uuid4().hex[:8]}"
    error = _publish_stops(url, kafka_bootstrap, topic, before)
    assert error["detail"] == {"tree_id": tree_id, "position": forged, "rule": "index.head_mismatch"}
    assert "events were added past it" in error["message"]


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
