"""A host's request that changes nothing on a parked run nobody owns appends nothing.

Such a request takes the run over in the same append as the request (the activation, what
it decides, the request). A request sent again ("already paused", a resolution or steering
resent under its id) changed nothing, yet the activation was appended every time: a host
retrying a request grew every parked history by one ``WriterActivated`` per retry (noticed in
an earlier session's note). Now nothing is appended, and the run stays unowned.
"""

from __future__ import annotations

from pathlib import Path

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import WriterActivated
from agentfold.domain.ids import TreeID
from tests.kernel_programs import asker_program
from tests.test_cli import agentfold, ok, sqlite_url
from tests.test_cli_interaction import approval, write


def history(url: str, tree_id: object) -> list[str]:
    store = EventStore(url, create=False)
    try:
        return [type(e.event).__name__ for e in store.read(tree_id)]  # type: ignore[arg-type]
    finally:
        store.close()


def test_a_pause_sent_again_to_a_parked_run_nobody_owns_appends_nothing(durable_store_url: str) -> None:
    program = asker_program()
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as first:
        handle = first.start(program, {}, start_id="noop-1")
        assert first.wait_idle(handle.tree_id, timeout=30).root.status == "waiting"
    root = handle.root_process_id
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as pausing:
        assert pausing.pause(root) is True  # a change: taken over and paused in one append
    paused = history(durable_store_url, handle.tree_id)
    assert paused.count(WriterActivated.__name__) == 1 and paused[-1] == "ControlRequested", paused
    for _ in range(3):
        with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as again:
            assert again.pause(root) is False  # already requested
            assert not again.owns(handle.tree_id)
    assert history(durable_store_url, handle.tree_id) == paused  # before: one WriterActivated more each time
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as resuming:
        assert resuming.resume(root) is True
        assert resuming.wait_idle(handle.tree_id, timeout=30).root.status == "waiting"


def test_the_cli_says_a_request_sent_again_changed_nothing_and_names_no_other_owner(tmp_path: Path) -> None:
    """Real processes: `agentfold pause` twice on a parked run nobody owns."""
    store = sqlite_url(tmp_path)
    ran = ok(agentfold("run", str(write(tmp_path, approval(None))), "--start-id", "noop-cli", "--json", store=store))
    root, tree_id = ran.json()["root_process_id"], ran.json()["tree_id"]
    first = ok(agentfold("pause", root, "--json", store=store)).json()
    assert (first["recorded"], first["driven"]) == (True, True)
    before = history(store, TreeID(tree_id))
    again = ok(agentfold("pause", root, store=store)).stdout
    assert again.startswith("already paused\n"), again
    # Before: "(another runtime owns this tree and drives it on)": nobody did, nobody had to.
    assert "another runtime" not in again, again
    assert ok(agentfold("pause", root, "--json", store=store)).json()["driven"] is True
    assert history(store, TreeID(tree_id)) == before


def test_an_answer_resent_to_a_finished_run_names_no_owner(tmp_path: Path) -> None:
    """Found by a docs walkthrough: it said "(another runtime owns this tree and drives it on)"."""
    store = sqlite_url(tmp_path)
    ok(agentfold("run", str(write(tmp_path, approval(None))), "--start-id", "resent", store=store))
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]
    argv = ("answer", wait["process_id"], wait["wait_id"], '{"approved": true}', "--signal-id", "a-1")
    assert ok(agentfold(*argv, "--json", store=store)).json()["tree"]["status"] == "completed"
    again = ok(agentfold(*argv, store=store)).stdout
    assert again.startswith("already answered with this signal id"), again
    assert "another runtime" not in again, again
