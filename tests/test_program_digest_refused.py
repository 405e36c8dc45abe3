"""A runtime refuses to drive a tree whose Program it binds only under another identity
(docs/guarantees.md "Determinism of your Programs"): the same name with a different
implementation digest is a different Program, whose ``evolve`` might read the recorded facts
differently. Recovery is refused with ``engine.program.unavailable`` and appends nothing; the
Program the tree names then recovers it as usual.
"""

from __future__ import annotations

import threading

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.ids import Digest
from agentfold.domain.program import Program
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program


def test_recovery_under_the_same_program_name_with_another_implementation_digest_is_refused(
    durable_store_url: str,
) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def held(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    original = chain_program(held, name="digest.chain")
    store = EventStore(durable_store_url)
    first = Runtime(store, Catalog([original]), poll_interval=0)
    handle = first.start(original, {"n": 1}, start_id="digest-1")
    assert entered.wait(20)
    first.close(timeout=5)  # its owner is gone with the call under way (as after a crash)
    release.set()
    version = store.head(handle.tree_id).version  # type: ignore[union-attr]

    impostor = Program(original.descriptor, original.strategy, Digest.of(b"a new evolve"),
                       original.configuration_digest, policy=original.policy,
                       dispatcher=FunctionDispatcher(lambda r, c: Settlement.succeeded({"value": 1})))
    assert impostor.ref.name == original.ref.name and impostor.ref != original.ref
    with Runtime(EventStore(durable_store_url), Catalog([impostor]), poll_interval=0) as other:
        with pytest.raises(AgentfoldError) as refused:
            other.recover(str(handle.tree_id))
        assert refused.value.code == "engine.program.unavailable", refused.value
        # It says what this process binds under the name, and which part of the identity differs.
        assert f"binds digest.chain as {impostor.ref.digest}, which differs in its implementation" \
            in refused.value.message, refused.value.message
        assert "configuration" not in refused.value.message
        assert "Catalog([new, old])" in (refused.value.hint or "")
    assert store.head(handle.tree_id).version == version  # type: ignore[union-attr]
    assert [type(r.event).__name__ for r in store.read(handle.tree_id)][-1] == "EffectDispatched"

    with Runtime(EventStore(durable_store_url), Catalog([original]), poll_interval=0) as right:
        (again,) = right.recover(str(handle.tree_id))
        tree = right.wait_idle(again.tree_id, timeout=20)
        unknown = [e for p in tree.processes.values() for e in p.unknown_effects()]
        assert [e.effect_id for e in unknown] == calls  # the call under way: unknown, not called again
    assert len(calls) == 1
