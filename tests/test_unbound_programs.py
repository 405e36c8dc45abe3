"""Runs whose Program a process does not bind: a worker's ``recover()`` leaves them alone and
says so instead of failing on the first one, and ``agentfold project`` reports that it
projects them without their Program (their read-model rows hold the kernel's view only).

A deployment changes a Program's identity (a tool's description, a new implementation digest)
while runs started with the old one are live: the next worker start used to die in
``Runtime.recover()`` on the first such run (``engine.program.unavailable``) and take up none of
the others; the plain ``agentfold project`` wrote rows without the runs' Interaction views, which
every reader then trusted, without a word.
"""

from __future__ import annotations

from pathlib import Path

from adapters.catalog import Catalog
from adapters.eventstore import EventStore
from adapters.runtime import Runtime
from domain.ids import TreeID
from domain.requests import Settlement
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold, ok


def lost_reply(request: object, context: object) -> Settlement:
    raise ConnectionResetError("the reply was lost")


def test_recover_takes_up_the_runs_it_can_and_lists_the_ones_whose_program_it_does_not_bind(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    kept, retired = chain_program(lost_reply, name="test.kept"), chain_program(lost_reply, name="test.retired")
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([kept, retired])) as old_worker:
            for program, start in ((retired, "old-run"), (kept, "run")):
                old_worker.wait_idle(old_worker.start(program, {"n": 2}, start_id=start).tree_id)
        retired_events = len(store.read(TreeID.for_start("old-run")))
        # The new deployment binds only the kept Program (its dispatcher now answers).
        kept_now = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="test.kept")
        assert kept_now.ref == kept.ref
        with Runtime(store, Catalog([kept_now])) as worker:
            handles = worker.recover()
            assert [str(h.start_id) for h in handles] == ["run"]
            [(tree, error)] = worker.recover_failures.items()
            assert tree == TreeID.for_start("old-run") and error.code == "engine.program.unavailable"
            [unknown] = [e for p in worker.capture("run").live.values() for e in p.unknown_effects()]
            worker.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 1}))
            assert handles[0].result(timeout=30).status == "completed"
        assert len(store.read(TreeID.for_start("old-run"))) == retired_events  # left alone: nothing appended
    finally:
        store.close()


def test_project_says_which_runs_it_projects_without_their_program(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    program = chain_program(lost_reply, name="myapp.refund")
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            runtime.wait_idle(runtime.start(program, {"n": 1}, start_id="refund-1").tree_id)
    finally:
        store.close()
    ran = ok(agentfold("project", store=url))
    tree = TreeID.for_start("refund-1")
    assert f"tree {tree} runs program 'myapp.refund', which this process does not bind" in ran.stderr, ran.stderr
    assert "project --rebuild" in ran.stderr
