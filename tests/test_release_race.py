"""A tree given up by its owner line while the same runtime takes it again keeps its lease.

Owner leases are re-entrant inside one process: a runtime that asks for a lease it holds
gets it. When an owner line stops (``Runtime.release``, a store failure, a lost race), its
tree leaves the runtime's owner lines and then its lease is given back. Another thread of
the same runtime taking the tree in between (input admitted for it, ``recover``, an orphan
scan) was handed the lease that was about to be given back: its new owner line then drove
the run without a lease, and another runtime could take the same run over (two owners; a
call made by one recorded unknown or made again by the other). Giving a tree up now
happens under the same per-tree lock as taking it, so the taking waits for the lease to be
given back and then takes it anew.

Real stores (a SQLite file's lock-file leases, PostgreSQL advisory locks), two runtimes in
one process with their own stores (their own leases); the interleaving is forced by holding
the lease's release until the other thread's adoption ran or waited for it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import asker_program


def test_a_tree_taken_again_while_its_owner_line_gives_it_up_keeps_its_lease(durable_store_url: str) -> None:
    program = asker_program("release.race")
    owner = Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0)
    peer = Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0)
    try:
        handle = owner.start(program, {}, start_id="release-race")
        tree_id = handle.tree_id
        assert owner.wait_idle(tree_id, timeout=30).classification() == "parked"
        real_release = owner._leases.release
        taking: list[threading.Thread] = []
        outcome: list[Any] = []

        def take_again() -> None:
            try:
                outcome.append(owner.recover(str(tree_id)))
            except Exception as exc:  # noqa: BLE001 - reported by the assertions below
                outcome.append(exc)

        def release(tree: Any) -> None:
            if tree == tree_id and not taking:
                # Another thread of this runtime takes the tree now, while its lease is still
                # held: it either runs at once (and must not be handed this lease) or waits for
                # the giving up to end.
                thread = threading.Thread(target=take_again, daemon=True)
                taking.append(thread)
                thread.start()
                thread.join(1.0)
            real_release(tree)

        owner._leases.release = release  # type: ignore[method-assign]
        owner.release(tree_id)
        assert taking, "releasing the tree gave back no lease"
        taking[0].join(30)
        assert not taking[0].is_alive()
        [handles] = outcome
        assert not isinstance(handles, BaseException), handles
        assert [h.tree_id for h in handles] == [tree_id]
        assert owner.owns(tree_id)
        # The owner that took it again holds its lease: another runtime cannot take the run over.
        with pytest.raises(Fenced) as refused:
            peer.recover(str(tree_id))
        assert refused.value.code == "engine.tree.owned"
        assert not peer.owns(tree_id)
        # And the run goes on where it is driven: the answer completes it.
        wait = owner.capture(tree_id).processes[handle.root_process_id].current_wait
        assert owner.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("race-answer"), {"name": "n"}, wait)])
        assert owner.result(tree_id, timeout=30).output == {"hello": "n"}
    finally:
        owner.close()
        peer.close()
        owner.store.close()
        peer.store.close()
