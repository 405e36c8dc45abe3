"""What long-lived processes (``agentfold serve``, a host's Runtime, a read-model follower) keep
of a run after it no longer needs it (a soak audit: /tmp/mem-hunt-work/*.py).

Each test fails on the structure that kept it: a stopped timer's heap entry held its finished
run for up to TICK_SECONDS (30 s), the stopped lines' errors were kept one per tree for good,
the follower remembered every unbound run it ever reported, and every side-effect log path
ever named kept a lock.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters import runtime as runtime_module
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime, _Driver
from agentfold.adapters.scenario import SideEffectLog
from agentfold.adapters.sources import default_sources
from agentfold.adapters.team import FIRST_COMPLETED, FirstSuccessConfig, compile_deadline, compile_first_success
from agentfold.domain.errors import Fenced
from tests.kernel_programs import asker_program, chain_program
from tests.team.test_timers import echo, soon
from tests.test_program_memory import start, unleased_pair


def lines_of(tree_id: Any) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, _Driver) and o.tree_id == tree_id)


def test_a_race_won_before_its_timeout_is_not_kept_by_the_stopped_timer(tmp_path: Path) -> None:
    """The timeout's timer is stopped when the worker wins; its heap entry stays until its next
    look (TICK_SECONDS, 30 s, away) and held the finished race's owner line, tree and Programs."""
    deadline, worker = compile_deadline("test.deadline"), echo()
    race = compile_first_success(FirstSuccessConfig(name="test.race", candidates=[worker, deadline],
                                                    accept=FIRST_COMPLETED, max_candidates=2))
    store = EventStore(f"sqlite:///{tmp_path / 'timers.db'}")
    runtime = Runtime(store, Catalog([race, deadline, worker]))
    try:
        handle = runtime.start(race, [{"key": "work", "program": "test.echo", "input": "fast"},
                                      {"key": "timeout", "program": "test.deadline", "input": soon(600)}])
        result = handle.result(30)
        assert result.status == "completed" and result.output["winner"] == 0, result.output
        assert runtime.timers_waiting() == 0
        until = time.monotonic() + 2  # far less than the timer's next look
        while lines_of(handle.tree_id) and time.monotonic() < until:
            time.sleep(0.05)
        assert lines_of(handle.tree_id) == 0
    finally:
        runtime.close()
        store.close()


def test_the_errors_of_stopped_owner_lines_are_kept_for_the_newest_trees_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fenced tree's error was kept for the runtime's life (one per tree another writer
    took over, finished or not); now the newest ``_FAILED_KEPT`` (4096; 3 here) are."""
    monkeypatch.setattr(runtime_module, "_FAILED_KEPT", 3)
    program = asker_program("memory.fenced")
    with unleased_pair(tmp_path, program) as (runtime, other):
        handles = []
        for i in range(6):
            handle = runtime.start(program, {}, start_id=f"fenced-{i}")
            runtime.wait_idle(handle.tree_id)
            other.recover(str(handle.tree_id))
            with pytest.raises(Fenced):
                runtime.pause(handle.root_process_id)
            handles.append(handle)
        assert len(runtime._failed) == 3
        with pytest.raises(Fenced):  # the newest still report the fence
            runtime.result(handles[-1].tree_id, timeout=5)


def test_a_follower_forgets_the_finished_runs_it_reported_unbound(tmp_path: Path) -> None:
    """A follower whose catalog does not bind a run's Program reports it once; it remembered
    every such run it ever followed (a server's follower beside a host's own Programs)."""
    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    runtime = Runtime(store, Catalog(), poll_interval=0)
    try:
        for i in range(5):
            handle = runtime.start(chain_program(name=f"host.chain-{i}"), {"n": 1}, start_id=f"r-{i}")
            assert handle.result(timeout=30).status == "completed"
        reported: list[str] = []
        follower = Follower(store, default_sources().catalog(), ReadModels(store), on_unbound=reported.append)
        follower.catch_up()
        assert len(reported) == 5  # each reported once
        assert follower._unbound == set()
    finally:
        runtime.close()
        store.close()


def test_side_effect_logs_of_many_runs_keep_no_lock_per_path(tmp_path: Path) -> None:
    """Every side-effect log path a process ever wrote kept a lock (and its path) for good."""
    def tool(i: int) -> dict[str, Any]:
        call = {"tool_calls": [{"id": "c1", "name": "t", "arguments": "{}"}]}
        return {"name": f"tool-{i}", "input": {"messages": [{"role": "user", "content": f"go {i}"}]},
                "side_effect_log": str(tmp_path / f"run-{i}.jsonl"),
                "tools": [{"name": "t", "parameters": {"type": "object"}, "result": {"output": f"x{i}"}}],
                "model": {"responses": [{"finish_reason": "tool_calls", "message": call},
                                        {"finish_reason": "stop", "message": {"content": "done"}}]}}

    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    runtime = Runtime(store, default_sources().catalog())
    try:
        before = len(SideEffectLog._locks)
        for i in range(4):
            assert start(runtime, tool(i), f"t-{i}").result(timeout=30).status == "completed"
        assert len(SideEffectLog._locks) == before
        assert all((tmp_path / f"run-{i}.jsonl").read_text().count("\n") == 1 for i in range(4))
    finally:
        runtime.close()
        store.close()
