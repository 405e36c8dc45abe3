"""A closing runtime starts no further dispatch and grants no new permission (docs/kernel-adaptations.md).

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

from agentfold.adapters.runtime import RuntimeStopped
from agentfold.domain.errors import EngineCode
from agentfold.domain.events import EffectDispatched, EffectSettled
from agentfold.domain.ids import effect_id
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


def test_a_step_committed_while_the_runtime_closes_permits_no_call_and_the_next_owner_makes_it(env: Env) -> None:
    """``close`` grants no dispatch permission once it begins: a run whose call returns while
    ``close`` waits for another run's append commits its next Step with the Effect declared
    but not permitted, and the next owner makes that call, instead of recording a call
    nobody made as unknown."""
    from tests.kernel_programs import CallLog, GatedCall

    held = chain_program(counted(env.log), name="closing.held")
    gate = GatedCall(CallLog(env.tmp_path / "moving.jsonl"), at=0)
    moving = chain_program(gate, name="closing.moving")
    runtime, faulty = env.runtime(held, moving)
    running = runtime.start(moving, {"n": 2})
    assert gate.entered.wait(10)  # its first call is in progress
    fault = faulty.arm(holding(EffectSettled), "block_after")
    runtime.start(held, {"n": 2})
    fault.wait()  # the other run's owner line is inside a store call: close has to wait for it

    with pytest.raises(RuntimeStopped) as busy:
        runtime.close(timeout=0.2)
    assert busy.value.code == "engine.runtime.busy"
    before = env.version(running.tree_id)
    gate.release.set()  # the first call returns while the runtime is closing
    deadline = time.monotonic() + 10
    while env.version(running.tree_id) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    committed = env.events(running.tree_id)[before:]
    second = effect_id(running.root_process_id, 2, 0)
    assert any(getattr(e, "effect_id", None) == second for e in committed), committed  # declared
    assert not any(isinstance(e, EffectDispatched) and e.effect_id == second for e in committed)  # not permitted
    fault.release("proceed")
    runtime.close(timeout=5)

    restorer, _ = env.runtime(held, moving)
    restorer.recover(str(running.tree_id))
    assert restorer.result(running.tree_id, timeout=30).status == "completed"
    tree = restorer.wait_idle(running.tree_id)
    assert [r for p in tree.processes.values() for r in p.unknown_effects()] == []
    assert [c["index"] for c in gate.log.calls()] == [0, 1]  # each call made once, the second by the next owner
