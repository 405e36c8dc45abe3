"""An append that committed although its writer heard a failure (the reply was lost).

The PostgreSQL recorder retries an append whose connection died (agentfold/adapters/recorders.py).
When the first attempt had committed and another writer appended right after it, the
retry is a version conflict (a stale duplicate, Scope's rule): the owner reloads the tree
and finds its own dispatch permission there. That call must still be made, exactly once;
before, the Effect stayed pending under a live owner and the tree never moved again.

The lost reply is staged in-process: the owner's store commits the append, another
runtime admits input (a pause) on its own store, then the owner's append reports the
conflict its retry would meet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore, VersionConflict
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import EffectDispatched, StepCommitted
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program


def test_a_dispatch_permission_committed_behind_a_lost_reply_is_still_called_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lost.db'}"
    calls: list[str] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(str(request.effect_id))
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, name="test.lost_reply")
    owner_store, other_store = EventStore(url), EventStore(url)
    owner = Runtime(owner_store, Catalog([program]))
    other = Runtime(other_store, Catalog([program]), poll_interval=0)
    real_append = owner_store.append
    staged: dict[str, Any] = {}

    def append_losing_one_reply(tree_id: Any, expected: int, events: Any, **kwargs: Any) -> Any:
        result = real_append(tree_id, expected, events, **kwargs)
        second_step = any(isinstance(e, StepCommitted) and e.step == 2 for e in events)
        if second_step and any(isinstance(e, EffectDispatched) for e in events) and not staged:
            staged["permission"] = next(e for e in events if isinstance(e, EffectDispatched)).effect_id
            root = owner_store.load(tree_id).state.root.process_id
            staged["paused"] = other.pause(root, "admitted elsewhere while the reply was lost")
            raise VersionConflict(tree_id, expected)  # what the retried append meets
        return result

    owner_store.append = append_losing_one_reply  # type: ignore[method-assign]
    try:
        handle = owner.start(program, {"n": 3}, start_id="lost-1")
        # The permission the owner committed without learning it is called; the pause then
        # holds the process after that call settles.
        deadline = time.monotonic() + 20
        while staged.get("permission") not in calls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert staged["paused"] is True
        assert staged["permission"] in calls, "the committed dispatch permission was never called"
        owner.wait_idle(handle.tree_id, timeout=20)
        assert owner.resume(handle.root_process_id) is True
        result = handle.result(timeout=20)
        assert (result.status, result.output) == ("completed", {"total": 3, "effects": 3})
        assert len(calls) == len(set(calls)) == 3  # every effect called once, none twice
    finally:
        owner.close()
        other.close()
        owner_store.close()
        other_store.close()
