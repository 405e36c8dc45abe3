"""A request refused on a run nobody drives appends nothing, not even the takeover (found by a
review racing real `agentfold resolve` commands; docs/cli.md "Exit status and errors",
docs/http-api.md "Writes").

A runtime that drives what it admits took a run nobody owned over first (its activation, and
the permission of the run's next call) and applied the request after. When another host's
input landed in between (two hosts resolving one unknown call with different outcomes), the
request was refused with the takeover already committed; the refused command then exited and
left the call it had just permitted unknown, though nothing had crashed. The takeover and the
request are one append now. Real SQLite files and PostgreSQL databases.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.events import EffectDispatched, EffectSettled, WriterActivated
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import CallLog, chain_program


def test_a_resolution_refused_after_another_hosts_lands_first_takes_nothing_over(
    durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = CallLog(tmp_path / "calls.jsonl")

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        log.record(index=request.payload["index"])
        if request.payload["index"] == 0:
            raise ConnectionError("the reply was lost")  # unknown: a host settles it
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, name="refused.chain")
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as owner:
            handle = owner.start(program, {"n": 2}, start_id="refused")
            (unknown,) = owner.wait_idle(handle.tree_id, timeout=30).root.unknown_effects()
        # The owner is gone; the run is parked on its unknown call. Two hosts resolve it with
        # different outcomes; the other one's lands between this host's look and its takeover.
        other = Runtime(store, Catalog([program]), adopt_on_admit=False)
        real = Runtime._try_adopt
        landed = threading.Event()

        def other_lands_first(self: Runtime, tree_id: Any, **kwargs: Any) -> Any:
            if self is not other and not landed.is_set():
                landed.set()
                other.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 2}))
            return real(self, tree_id, **kwargs)

        monkeypatch.setattr(Runtime, "_try_adopt", other_lands_first)
        before = [r.event for r in store.read(handle.tree_id)]
        host = Runtime(store, Catalog([program]))
        try:
            with pytest.raises(AgentfoldError) as refused:
                host.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 3}))
            assert refused.value.code == "engine.effect.not_pending"
            assert landed.is_set()
            after = [r.event for r in store.read(handle.tree_id)]
            assert len(after) == len(before) + 1  # the other host's resolution, and nothing else
            assert not any(isinstance(e, (WriterActivated, EffectDispatched)) for e in after[len(before):])
            assert not host.owns(handle.tree_id)
        finally:
            host.close()
            other.close()
        monkeypatch.undo()
        with Runtime(store, Catalog([program])) as worker:
            worker.recover()
            result = worker.result(handle.tree_id, timeout=30)
        assert result.status == "completed" and result.output == {"total": 3, "effects": 2}  # 2 (resolved) + 1
        stream = [r.event for r in store.read(handle.tree_id)]
        assert [e.status for e in stream if isinstance(e, EffectSettled)] == ["unknown", "succeeded"]
        assert [c["index"] for c in log.calls()] == [0, 1]  # each call made once, none left unknown
    finally:
        store.close()
