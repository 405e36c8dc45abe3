"""A closing runtime starts no further dispatch (docs/kernel-adaptations.md), found by mutation.

Scenarios 23 and 24 abort the blocked store call, so the owner line never reached the point
where it would start the next call; a runtime that started it anyway went unnoticed. Here the
blocked append is let through while ``close`` waits for it: the permission it committed must
not be called by the closing runtime, and recovery settles it unknown without calling it.
Runs on memory, SQLite and PostgreSQL (``store_url``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.runtime import RuntimeStopped
from domain.errors import EngineCode
from domain.events import EffectDispatched, EffectSettled
from domain.ids import effect_id
from tests.conformance.programs import counted
from tests.conformance.support import Env, holding
from tests.kernel_programs import chain_program


@pytest.fixture
def env(store_url: str, tmp_path: Path) -> Iterator[Env]:
    environment = Env(store_url, tmp_path)
    yield environment
    environment.close()
    assert not environment.probe_failures, environment.probe_failures


def test_a_closing_runtime_starts_no_call_for_a_permission_its_last_append_committed(env: Env) -> None:
    program = chain_program(counted(env.log), name="mutants.close.chain")
    runtime, faulty = env.runtime(program)
    fault = faulty.arm(holding(EffectSettled), "block_after")
    handle = runtime.start(program, {"n": 2})
    fault.wait()
    second = effect_id(handle.root_process_id, 2, 0)
    # The held append (written, its acknowledgement held) permits the second call.
    assert any(isinstance(e, EffectDispatched) and e.effect_id == second for e in fault.events)
    assert env.log.count() == 1

    with pytest.raises(RuntimeStopped) as busy:
        runtime.close(timeout=0.2)
    assert busy.value.code == "engine.runtime.busy"
    fault.release("proceed")  # the store call returns normally while the runtime is closing

    # Nothing is called, however long we look (the dispatcher answers at once when called).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert env.log.count() == 1, env.log.calls()
        time.sleep(0.02)
    runtime.close(timeout=5)
    assert env.log.count() == 1

    # The committed permission is decided by recovery: unknown (policy never), not called.
    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    tree = restorer.wait_idle(handle.tree_id)
    unknown = [r for p in tree.processes.values() for r in p.unknown_effects()]
    assert [r.effect_id for r in unknown] == [second]
    assert unknown[0].diagnostic is not None and unknown[0].diagnostic.code == EngineCode.DISPATCH_INTERRUPTED
    assert env.log.count() == 1
