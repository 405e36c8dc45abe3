"""Input admitted by a runtime that does not own the tree is judged on the tree as its live
owner sees it, not as an adoption would leave it.

Before admitting input to a tree it does not drive, a runtime checks the request on a scratch
copy "as the new owner would see it": activated, its in-flight Effects decided. When another
live runtime owns the tree, no adoption happens, and that view is wrong: a second ``cancel``
while the first one waits for a call under way was refused with ``engine.process.finished``
("already ended canceled") although the process had not ended. Now it is what a repeated
cancel is everywhere else: nothing recorded (``False``), no error. Real leases on SQLite
(file locks) and PostgreSQL (advisory locks), two runtimes with their own store connections.
"""

from __future__ import annotations

import threading

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program


def test_a_second_cancel_while_the_owner_waits_for_a_call_records_nothing_and_is_not_refused(
    durable_store_url: str,
) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(request: EffectRequest, context: DispatchContext) -> Settlement:
        entered.set()
        release.wait(30)  # a call that takes its time to notice the cancellation
        return Settlement.succeeded({"value": 1})

    program = chain_program(slow, name="owned.chain")
    owner_store, other_store = EventStore(durable_store_url), EventStore(durable_store_url)
    try:
        with Runtime(owner_store, Catalog([program]), poll_interval=0, cancel_grace=30) as owner, \
                Runtime(other_store, Catalog([program]), poll_interval=0) as other:
            handle = owner.start(program, {"n": 2}, start_id="owned-1")
            assert entered.wait(20)
            assert owner.cancel(handle.root_process_id, reason="first") is True
            version = other_store.head(handle.tree_id).version  # type: ignore[union-attr]
            assert other.cancel(handle.root_process_id, reason="second") is False  # was: engine.process.finished
            assert other_store.head(handle.tree_id).version == version  # nothing recorded, no takeover
            assert not other.drives(handle.tree_id)
            release.set()
            result = handle.result(timeout=30)
            assert result.status == "canceled", result
            assert result.termination is not None and result.termination["reason"] == "first"
    finally:
        release.set()
        owner_store.close()
        other_store.close()
