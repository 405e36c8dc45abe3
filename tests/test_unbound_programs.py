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

import threading
from pathlib import Path

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold, ok


def lost_reply(request: object, context: object) -> Settlement:
    raise ConnectionResetError("the reply was lost")


def test_recover_takes_up_the_runs_it_can_and_lists_the_ones_whose_program_it_does_not_bind(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    entered, release = threading.Semaphore(0), threading.Event()

    def held(request: object, context: object) -> Settlement:
        entered.release()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    kept, retired = chain_program(held, name="test.kept"), chain_program(held, name="test.retired")
    store = EventStore(url)
    try:
        # The old worker stops while each run's first call is in flight: both need recovery.
        old_worker = Runtime(store, Catalog([kept, retired]))
        for program, start in ((retired, "old-run"), (kept, "run")):
            old_worker.start(program, {"n": 2}, start_id=start)
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
        old_worker.close()
        release.set()
        retired_events = len(store.read(TreeID.for_start("old-run")))
        # The new deployment binds only the kept Program (its dispatcher now answers at once).
        kept_now = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="test.kept")
        assert kept_now.ref == kept.ref
        with Runtime(store, Catalog([kept_now])) as worker:
            handles = worker.recover()
            assert [str(h.start_id) for h in handles] == ["run"]
            [(tree, error)] = worker.recover_failures.items()
            assert tree == TreeID.for_start("old-run") and error.code == "engine.program.unavailable"
            # The call in flight when the old worker stopped is unknown, never made again.
            [unknown] = [e for p in worker.wait_idle(handles[0].tree_id).live.values() for e in p.unknown_effects()]
            worker.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 1}))
            assert handles[0].result(timeout=30).status == "completed"
            # Asked again: the retired run still cannot be taken, and says so again.
            assert worker.recover() == []
            assert [(t, e.code) for t, e in worker.recover_failures.items()] == [(tree, "engine.program.unavailable")]
        assert len(store.read(TreeID.for_start("old-run"))) == retired_events  # left alone: nothing appended
    finally:
        store.close()


def test_a_worker_start_leaves_parked_runs_as_they_are(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    program = chain_program(lost_reply, name="test.parked")
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as first:
            first.wait_idle(first.start(program, {"n": 2}, start_id="parked").tree_id)  # parked on an unknown
        before = len(store.read(TreeID.for_start("parked")))
        for _restart in range(3):
            with Runtime(store, Catalog([program])) as worker:
                assert worker.recover() == [] and worker.recover_failures == {}
        assert len(store.read(TreeID.for_start("parked"))) == before  # no WriterActivated per restart
        with Runtime(store, Catalog([program])) as worker:  # one tree by name: taken whatever its state
            [handle] = worker.recover("parked")
            assert worker.owns(handle.tree_id)
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


def test_an_answer_for_a_run_whose_program_is_not_bound_says_so_and_appends_nothing(tmp_path: Path) -> None:
    from agentfold.adapters.host import Host
    from agentfold.domain.errors import NotFound
    from tests.test_cli import refused
    from tests.test_host_python import agent, parked_on_approval

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    program = agent()
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run, pending = parked_on_approval(runtime, program, "answer-me")
        before = len(store.read(run.tree_id))
        # The plain console script binds no such Program: it cannot read the wait, and says why
        # (it used to answer "wait W is not a pending tool input (its current wait is W)").
        error = refused(agentfold("answer", pending["process_id"], pending["wait_id"], '{"ok": true}', "--json",
                                  store=url)).error()
        assert error["code"] == "engine.program.unavailable", error
        with Runtime(store) as bare:
            try:
                Host(bare).answer(pending["process_id"], pending["wait_id"], {"ok": True})
            except NotFound as exc:
                assert exc.code == "engine.program.unavailable"
            else:
                raise AssertionError("answered without the Program")
        assert len(store.read(run.tree_id)) == before
    finally:
        store.close()


def test_a_model_response_for_a_run_whose_program_is_not_bound_says_so_and_appends_nothing(tmp_path: Path) -> None:
    # Found by a review: the plain script listed the effect as a model call (`unknown`), then
    # refused `resolve --model-response` with "is not a model call; give --output" (HTTP: 422
    # "give output"); the operator who followed that advice only then learned the real reason.
    from agentfold.adapters.host import Host
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.models import ScriptedModel
    from agentfold.domain.errors import NotFound
    from tests.test_cli import refused

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    program = compile_interaction(InteractionConfig(
        name="myapp.lost_model", model=ScriptedModel([{"error": "the connection dropped"}]), tools=[]))
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "hi"}]}, start_id="lost-model")
            runtime.wait_idle(run.tree_id)
        listed = ok(agentfold("unknown", "--json", store=url)).json()["unknown_effects"]
        [entry] = listed
        assert entry["kind"] == "model", entry
        before = len(store.read(run.tree_id))
        response = '{"finish_reason": "stop", "message": {"content": "hello"}}'
        error = refused(agentfold("resolve", entry["effect_id"], "--model-response", response, "--json",
                                  store=url)).error()
        assert error["code"] == "engine.program.unavailable", error
        assert "myapp.lost_model" in error["message"], error
        with Runtime(store) as bare:
            try:
                Host(bare).resolve(entry["effect_id"], model_response={"finish_reason": "stop",
                                                                         "message": {"content": "hello"}})
            except NotFound as exc:
                assert exc.code == "engine.program.unavailable"
            else:
                raise AssertionError("resolved without the Program")
        assert len(store.read(run.tree_id)) == before
        # With its Program bound, the same response settles the call.
        with Runtime(store, Catalog([program])) as runtime:
            Host(runtime).resolve(entry["effect_id"], model_response={"finish_reason": "stop",
                                                                        "message": {"content": "hello"}})
            assert runtime.wait_idle(run.tree_id).root.status == "completed"
    finally:
        store.close()
