"""A long-lived runtime or follower keeps the Programs of the runs it holds, not of every run it
ever started (found by a soak audit: ``agentfold serve`` grew by ~31 MB per 1,000 scenario runs
and never gave it back, and Python's full collections froze it for up to 2.9 s).

Each scenario document is its own Program (its digest covers the document); the catalog now
keeps a Program it can rebuild from a run's stored configuration only while a held tree uses
it (plus the few most recently used), and rebuilds it when a run needs it again.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import RECENT_PROGRAMS
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_input, scenario_program, validate_scenario
from agentfold.adapters.sources import default_sources
from agentfold.domain.program import Program, ProgramRef
from tests.test_cli_interaction import approval

RUNS = 3 * RECENT_PROGRAMS


def hello(i: int) -> dict[str, Any]:
    return {
        "name": f"hello-{i}",
        "input": {"messages": [{"role": "user", "content": f"Say hello to guest {i}."}]},
        "model": {"responses": [{"finish_reason": "stop", "message": {"content": f"Hello, guest {i}."}}]},
    }


def start(runtime: Runtime, doc: dict[str, Any], start_id: str) -> Any:
    doc = validate_scenario(doc)
    return runtime.start(scenario_program(doc), scenario_input(doc), start_id=start_id, configuration=doc)


def live_programs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Program))


def live_hello_programs() -> list[Program]:
    """The live Programs of this module's hello documents: what another test's thread still
    running in this process builds meanwhile is not counted (65 of 64 seen twice in CI)."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, Program) and isinstance(o.configuration, dict)
            and str(o.configuration.get("name", "")).startswith("hello-")]


def holders(programs: list[Program]) -> list[tuple[str, list[str]]]:
    """Each Program's name with the types of what refers to it (for a failure's message)."""
    return [(str(p.configuration["name"]), sorted(type(r).__name__ for r in gc.get_referrers(p)
                                                  if r is not programs))
            for p in programs]


def test_a_runtime_holds_the_programs_of_its_live_runs_only_and_rebuilds_a_released_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    runtime = Runtime(store, default_sources().catalog())
    try:
        parked = start(runtime, approval(None), "parked")
        runtime.wait_idle(parked.tree_id)
        earlier = {id(p) for p in live_hello_programs()}  # another test's, in this process
        for i in range(RUNS):
            assert start(runtime, hello(i), f"hello-{i}").result(timeout=30).status == "completed"
        # At most the recently used ones stay (each scenario here is one Program), not one per run.
        # The last run's tree is released just after its result is published: under load its
        # Program could still be held when first counted.
        deadline = time.monotonic() + 10
        while len(held := [p for p in live_hello_programs() if id(p) not in earlier]) > RECENT_PROGRAMS \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(held) <= RECENT_PROGRAMS, (len(held), RUNS, holders(held))
        # Nor anything else of a released Program: its ProgramRef was kept by the runtime's
        # answer to "does this Program wait on the timer thread" (one entry per Program, for good).
        digests = {scenario_program(validate_scenario(hello(i))).ref.digest for i in range(RUNS)}
        gc.collect()
        refs = {o.digest for o in gc.get_objects() if isinstance(o, ProgramRef) and o.digest in digests}
        assert refs <= {p.ref.digest for p in live_hello_programs()}, (len(refs), RECENT_PROGRAMS)
        # The parked run's Programs were held by its tree all along: a human answer resumes it.
        host = Host(runtime)
        [wait] = host.pending()
        host.answer(wait["process_id"], wait["wait_id"], {"approved": True})
        assert runtime.result(parked.tree_id, timeout=30).status == "completed"
        # A finished run's Program is rebuilt from its stored configuration when asked for again.
        first = runtime.catalog.resolve(runtime.capture("hello-0").root.program)
        assert first is not None and first.descriptor.name == "agentfold.scenario"
    finally:
        runtime.close()
        store.close()


def test_a_follower_keeps_no_finished_run_nor_its_programs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    runtime = Runtime(store, default_sources().catalog())
    try:
        for i in range(RUNS):
            assert start(runtime, hello(i), f"hello-{i}").result(timeout=30).status == "completed"
    finally:
        runtime.close()
    try:
        before = live_programs()
        follower = Follower(store, default_sources().catalog(), ReadModels(store))
        follower.catch_up()
        assert len(ReadModels(store).runs(limit=1000)) == RUNS  # every run projected, with its Program
        # Finished runs leave the follower's cache (1,024 trees by default) with their Programs:
        # what stays is its catalog's own Programs (the kernel demo's) and the recent ones.
        grown = live_programs() - before
        assert grown <= len(default_sources().catalog().programs()) + RECENT_PROGRAMS, (grown, RUNS)
        del follower
    finally:
        store.close()


def test_a_run_finished_after_input_admitted_elsewhere_is_not_kept_by_the_watcher(tmp_path: Path) -> None:
    """The watcher that hands a tree's owner line what another writer appended kept that line
    (its tree, its Programs) in a local variable until it next found a tree behind: a run
    answered from another process stayed in memory after it finished. Under load the same held
    one finished run of a long-lived server (CI: a ``hello-18`` Program held by its ``Bound``
    after 190 more runs)."""
    from agentfold.adapters.runtime import _Driver

    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store, elsewhere_store = EventStore(url), EventStore(url)
    runtime = Runtime(store, default_sources().catalog(), poll_interval=0.02)
    elsewhere = Runtime(elsewhere_store, default_sources().catalog(), poll_interval=0, adopt_on_admit=False)
    try:
        parked = start(runtime, approval(None), "parked")
        runtime.wait_idle(parked.tree_id)
        [wait] = Host(elsewhere).pending()
        Host(elsewhere).answer(wait["process_id"], wait["wait_id"], {"approved": True})  # recorded, not driven
        assert runtime.result(parked.tree_id, timeout=30).status == "completed"  # the owner caught up

        def lines_of_the_run() -> int:
            gc.collect()
            return sum(1 for o in gc.get_objects() if isinstance(o, _Driver) and o.tree_id == parked.tree_id)

        deadline = time.monotonic() + 5  # 250 polls of the watcher
        while lines_of_the_run() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines_of_the_run() == 0
    finally:
        elsewhere.close()
        runtime.close()
        elsewhere_store.close()
        store.close()


@contextlib.contextmanager
def unleased_pair(tmp_path: Path, program: Program) -> Iterator[tuple[Runtime, Runtime]]:
    """Two runtimes on one SQLite file whose ownership is decided by version fencing alone (an
    owner that lost its lease): what one takes over, the other's owner line is fenced on."""
    from agentfold.adapters.catalog import Catalog
    from tests.crash.worker import GrantAllLeases

    class Unleased(EventStore):
        def leases(self) -> Any:
            return GrantAllLeases()

    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    ours, theirs = Unleased(url), Unleased(url)
    runtime = Runtime(ours, Catalog([program]), poll_interval=0)
    other = Runtime(theirs, Catalog([program]), poll_interval=0)
    try:
        yield runtime, other
    finally:
        other.close()
        runtime.close()
        theirs.close()
        ours.close()


def test_a_fenced_owner_line_is_let_go_and_its_error_raised_again_does_not_grow(tmp_path: Path) -> None:
    """An owner line fenced by another writer is stopped, and the runtime keeps its error so that
    later ``result()`` calls report the fence. It kept the error as raised: its traceback held
    the frames that raised it (the stopped line, its tree, its Programs) for the runtime's life,
    one per fenced tree; and each ``result()`` raised that very object again, which grows its
    traceback by the raising frames every time (and holds them)."""
    from agentfold.adapters.runtime import _Driver
    from agentfold.domain.errors import Fenced
    from tests.kernel_programs import asker_program

    program = asker_program("memory.fenced")
    with unleased_pair(tmp_path, program) as (runtime, other):
        handle = runtime.start(program, {})
        assert runtime.wait_idle(handle.tree_id).root.status == "waiting"
        other.recover(str(handle.tree_id))  # another writer activates the tree
        try:
            runtime.pause(handle.root_process_id)  # our line's append is fenced
        except Fenced as exc:
            assert exc.code == "engine.tree.incarnation_conflict"
        else:
            raise AssertionError("the fenced line appended")

        def traceback_length() -> int:
            try:
                runtime.result(handle.tree_id, timeout=5)
            except Fenced as exc:
                tb, length = exc.__traceback__, 0
                while tb is not None:
                    tb, length = tb.tb_next, length + 1
                return length
            raise AssertionError("result() of a fenced tree did not report the fence")

        first = traceback_length()
        for _ in range(20):
            traceback_length()
        assert traceback_length() == first
        gc.collect()
        assert [o for o in gc.get_objects() if isinstance(o, _Driver) and o.runtime is runtime] == []


def test_a_server_builds_and_holds_a_parked_runs_programs_once(tmp_path: Path) -> None:
    """serve: its runtime, its read-model follower and its reads share one catalog. The
    follower had its own, so a parked run's Programs were built and held twice (the runtime's
    tree and the follower's cache), and a read that folded a run rebuilt its scenario again."""
    from agentfold.adapters.http_api import ApiService

    def live_approvals() -> list[Program]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, Program) and isinstance(o.configuration, dict)
                and o.configuration.get("name") == "approval"]

    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    service = ApiService.open(store, default_sources(), "t" * 40)
    try:
        assert service.follower is not None
        parked = start(service.runtime, approval(None), "parked")
        service.runtime.wait_idle(parked.tree_id)
        deadline = time.monotonic() + 30
        while (not ReadModels.exist(store) or ReadModels(store, create=False).position() < store.max_notification_id()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ReadModels(store, create=False).runs(limit=10), "the follower did not project the run"
        state, programs = service.queries.fold(parked.tree_id)  # a read that folds the run binds its Programs
        assert programs is not None and state.root.status == "waiting"
        held = live_approvals()
        assert len(held) == 1, holders(held)
    finally:
        service.close()
        store.close()
