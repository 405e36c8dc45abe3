"""A Program's identity, its child bindings and the catalogue (a mutation audit of the
"programs" area: behaviour no test defended).

docs/concepts.md: a ProgramRef is the name plus four digests (contract, implementation,
configuration, bindings), "the runtime refuses to drive a Process with any other binding
(`engine.program.unavailable`): old histories are never run by silently changed code";
docs/python.md "What to keep stable between deployments". Each test here failed with a
planted bug (a digest leaving out part of the Program, a child or a Program found by its
name only, a recorded Program rebuilt as another) and passes without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.drift import find_drift
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.events import EffectSettled
from agentfold.domain.ids import Digest, TreeID
from agentfold.domain.program import Complete, Descriptor, Program, Signal, Step
from tests.audit.support import Sql
from tests.kernel_programs import IMPL, Asker, Chain, JsonStrategy, Parent, chain_program, config_digest

NAME = "test.identity"


def asker(descriptor: Descriptor | None = None, children: Sequence[Program] = ()) -> Program:
    """A Program whose run parks at once (it waits for an answer): a run to take up later."""
    return Program(descriptor or Descriptor(NAME), Asker(), IMPL, config_digest(NAME), children=tuple(children))


class Echo(JsonStrategy):
    """Completes at once with what ``initial`` made of its input, and the version that made it."""

    def __init__(self, version: str) -> None:
        self.version = version

    def initial(self, input: Any) -> Any:
        return {"input": input, "started_by": self.version}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Complete({"input": state["input"], "started_by": state["started_by"]}), {})


def worker(version: str) -> Program:
    """One release of the child Program ``test.worker``: same name, its own implementation digest."""
    return Program(Descriptor("test.worker"), Echo(version), Digest.of(f"test.worker/{version}".encode()),
                   config_digest("test.worker"))


def parked_run(tmp_path: Path, program: Program) -> tuple[EventStore, TreeID, int]:
    """Start ``program`` in a SQLite store, let it park, close its runtime (the worker is gone)."""
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    with Runtime(store, Catalog([program]), poll_interval=0) as first:
        tree_id = first.start(program, None, start_id="run-1").tree_id
        assert first.wait_idle(tree_id, timeout=20).classification() == "parked"
    head = store.head(tree_id)
    assert head is not None
    return store, tree_id, head.version


def refused_recovery(store: EventStore, tree_id: TreeID, program: Program) -> AgentfoldError:
    """What taking the run up with only ``program`` bound raises (it must raise)."""
    with Runtime(store, Catalog([program]), poll_interval=0) as other, pytest.raises(AgentfoldError) as refused:
        other.recover(str(tree_id))
    return refused.value


@pytest.mark.parametrize(("changed", "part"), [
    ({"input_schema": {"type": "object"}}, "input"),
    ({"output_schema": {"type": "object", "required": ["hello"]}}, "output"),
    ({"signal_schema": {"type": "object"}}, "signal"),
])
def test_a_run_is_not_taken_up_by_its_program_with_another_schema_under_the_same_name_and_digests(
    tmp_path: Path, changed: dict[str, Any], part: str,
) -> None:
    """The contract digest covers each schema of the Descriptor: a release that changed only the
    output (or signal, or input) schema is another Program, refused for the runs of the old one."""
    store, tree_id, version = parked_run(tmp_path, asker())
    try:
        new = asker(Descriptor(NAME, **changed))
        assert new.ref.implementation_digest == asker().ref.implementation_digest
        error = refused_recovery(store, tree_id, new)
        assert error.code == "engine.program.unavailable", (part, error)
        assert "differs in its Descriptor" in error.message, error.message
        assert store.head(tree_id).version == version  # type: ignore[union-attr]  # nothing appended
        with Runtime(store, Catalog([asker()]), poll_interval=0) as right:  # the recorded Program takes it
            assert [h.tree_id for h in right.recover(str(tree_id))] == [tree_id]
    finally:
        store.close()


def test_a_run_is_not_taken_up_by_its_program_bound_to_another_release_of_its_child(tmp_path: Path) -> None:
    """The bindings digest covers each child binding: the same parent bound to v2 of its child
    is not the Program that started a run bound to v1 (that run's children would start v1)."""
    store, tree_id, version = parked_run(tmp_path, asker(children=[worker("v1")]))
    try:
        error = refused_recovery(store, tree_id, asker(children=[worker("v2")]))
        assert error.code == "engine.program.unavailable", error
        assert "differs in its child Programs" in error.message, error.message
        assert "implementation" not in error.message and "Descriptor" not in error.message, error.message
        assert store.head(tree_id).version == version  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_child_started_from_one_of_two_releases_bound_under_one_name_runs_that_release(tmp_path: Path) -> None:
    """A parent binding v1 and v2 of ``test.worker`` starts v2: the child is started (its input
    checked and its initial state made) by v2, the exact binding it names, not by the first
    child of that name."""
    v1, v2 = worker("v1"), worker("v2")
    parent = Program(Descriptor("test.two.releases"), Parent(v2, 1), IMPL, config_digest("test.two.releases"),
                     children=(v1, v2))
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        with Runtime(store, Catalog([parent]), poll_interval=0) as runtime:
            result = runtime.start(parent, {"child": {"x": 1}}, start_id="two").result(timeout=20)
        assert result.status == "completed", result
        assert result.output == {"outcomes": [{"status": "completed",
                                               "output": {"input": {"x": 1}, "started_by": "v2"}}]}
    finally:
        store.close()


def test_a_parent_cannot_start_a_program_its_tree_binds_only_under_another_child(tmp_path: Path) -> None:
    """The child a ``start_child`` names must be one of the parent Program's own bindings: a
    grandchild the tree binds (under the parent's child) started by the parent directly is a
    failed start (``engine.child.deployment_unavailable``) the parent sees, not a started child."""
    grandchild = worker("v1")
    child = Program(Descriptor("test.middle"), Echo("middle"), IMPL, config_digest("test.middle"),
                    children=(grandchild,))
    parent = Program(Descriptor("test.skips.a.level"), Parent(grandchild, 1), IMPL,
                     config_digest("test.skips.a.level"), children=(child,))
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        with Runtime(store, Catalog([parent]), poll_interval=0) as runtime:
            handle = runtime.start(parent, {"child": {"x": 1}}, start_id="skip")
            result = handle.result(timeout=20)
            tree = runtime.capture(handle.tree_id)
        assert (result.status, result.output) == ("completed", {"started": 0}), result
        assert list(tree.processes) == [tree.root_id]  # no child was started
        [settled] = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectSettled)]
        assert settled.payload["failure"]["code"] == "engine.child.deployment_unavailable", settled.payload
    finally:
        store.close()


class RaisesAtStep2(Chain):
    """The chain as an earlier release decided it: its decide raised on the first result."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["done"] + len(window) == 1:
            raise RuntimeError("that release did not handle a result")
        return super().decide(state, window)


def test_drift_names_a_step_whose_recorded_decide_raised_and_the_current_code_decides(tmp_path: Path) -> None:
    """A recorded failure of ``decide`` (a ``ProcessTerminated`` with no ``StepCommitted``) is a
    decision too: the current code, which decides that Step, drifts from it there."""
    current = chain_program()
    earlier = Program(current.descriptor, RaisesAtStep2(), IMPL, current.configuration_digest,
                      policy=current.policy, dispatcher=current.dispatcher)
    assert earlier.ref == current.ref  # the same identity: only drift can tell
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        with Runtime(store, Catalog([earlier]), poll_interval=0) as runtime:
            handle = runtime.start(earlier, {"n": 2}, start_id="raised")
            assert handle.result(timeout=20).status == "failed"
        records = [(r.position, r.event) for r in store.read(handle.tree_id)]
        assert find_drift(records, Catalog([earlier]).resolve).ok  # the code that wrote it agrees
        report = find_drift(records, Catalog([current]).resolve)
        assert not report.ok and report.drift is not None, report
        terminated = next(p for p, e in records if type(e).__name__ == "ProcessTerminated")
        assert (report.drift.step, report.drift.position) == (2, terminated), report.drift
        assert report.drift.path == "ProcessTerminated (the current code records StepCommitted)"
    finally:
        store.close()


def test_recover_reports_a_run_listed_parked_that_needs_an_owner_when_its_program_is_not_bound(
    tmp_path: Path,
) -> None:
    """A run whose index row says parked (as a release before the cancel rule stored it) but
    whose history holds a cancel to carry out needs an owner: a worker that does not bind its
    Program lists it in ``recover_failures`` (``engine.program.unavailable``), it does not pass
    it over as a parked run with nothing to do."""
    program = asker()
    store, tree_id, _ = parked_run(tmp_path, program)
    try:
        host = Runtime(store, Catalog([program]), adopt_on_admit=False, poll_interval=0)
        try:
            assert host.cancel(host.capture(tree_id).root.process_id, "user gave up")
        finally:
            host.close()
        Sql(f"sqlite:///{tmp_path / 'runs.db'}")._run(
            "UPDATE agentfold_trees SET classification = 'parked' WHERE tree_id = ?", (str(tree_id),))
        version = store.head(tree_id).version  # type: ignore[union-attr]
        with Runtime(store, Catalog([chain_program()]), poll_interval=0) as other:
            assert other.recover() == []
            assert [(t, e.code) for t, e in other.recover_failures.items()] == [
                (tree_id, "engine.program.unavailable")]
        assert store.head(tree_id).version == version  # type: ignore[union-attr]
    finally:
        store.close()


def test_recover_goes_on_past_runs_whose_loader_cannot_rebuild_their_program(tmp_path: Path) -> None:
    """A loader of the new release that cannot read a run's stored configuration (it raises) is
    a Program this worker cannot bind: a parked run with nothing in flight is left as it is, and a
    run that needs an owner is listed in ``recover_failures``; ``recover()`` does not stop on
    either (it raised the loader's KeyError, from the parked run, and took up no run)."""
    base = asker()
    stored = dataclasses.replace(base, configuration={"format": 1})

    def reads_old_documents(doc: Any) -> Program:
        return dataclasses.replace(base, configuration=doc)

    def reads_new_documents_only(doc: Any) -> Program:
        raise KeyError("format 2")

    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        with Runtime(store, Catalog(loaders={NAME: reads_old_documents}), poll_interval=0,
                     adopt_on_admit=False) as first:
            parked, canceled = (first.start(stored, None, start_id=s).tree_id for s in ("parked", "canceled"))
            for tree_id in (parked, canceled):
                assert first.wait_idle(tree_id, timeout=20).classification() == "parked"
        host = Runtime(store, Catalog(loaders={NAME: reads_old_documents}), adopt_on_admit=False, poll_interval=0)
        try:  # recorded, not carried out: the run needs an owner
            assert host.cancel(host.capture(canceled).root.process_id, "user gave up")
        finally:
            host.close()
        versions = {t: store.head(t).version for t in (parked, canceled)}  # type: ignore[union-attr]
        with Runtime(store, Catalog(loaders={NAME: reads_new_documents_only}), poll_interval=0) as worker:
            assert worker.recover() == []
            [(tree, error)] = worker.recover_failures.items()
            assert (tree, error.code) == (canceled, "engine.program.unavailable"), error
            assert "from its stored configuration failed: KeyError" in error.message, error.message
            # A host command on such a run is refused with the same code, never the loader's raw KeyError.
            with pytest.raises(AgentfoldError) as refused:
                worker.cancel(worker.capture(parked).root.process_id, "stop")
            assert refused.value.code == "engine.program.unavailable", refused.value
        assert {t: store.head(t).version for t in (parked, canceled)} == versions  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_run_whose_stored_configuration_now_rebuilds_another_program_is_refused(tmp_path: Path) -> None:
    """The loader rebuilds a run's Program from its stored configuration; when the new release's
    loader makes another Program of it (another identity), the run is refused
    (``engine.program.unavailable``), never driven by the Program the loader made."""
    def release(version: str) -> Any:
        def load(doc: Any) -> Program:
            return Program(Descriptor(NAME), Asker(), Digest.of(f"{NAME}/{version}".encode()), config_digest(NAME),
                           configuration=doc)
        return load

    old, new = release("1"), release("2")
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        with Runtime(store, Catalog(loaders={NAME: old}), poll_interval=0) as first:
            tree_id = first.start(old({"prompt": "name?"}), None, start_id="old-release").tree_id
            root = first.wait_idle(tree_id, timeout=20).root.process_id
        version = store.head(tree_id).version  # type: ignore[union-attr]
        with Runtime(store, Catalog(loaders={NAME: new}), poll_interval=0) as worker:
            with pytest.raises(AgentfoldError) as refused:
                worker.recover(str(tree_id))
            assert refused.value.code == "engine.program.unavailable", refused.value
            assert "the stored configuration rebuilds" in refused.value.message, refused.value.message
            with pytest.raises(AgentfoldError) as answered:
                worker.cancel(root, "user gave up")
            assert answered.value.code == "engine.program.unavailable", answered.value
        assert store.head(tree_id).version == version  # type: ignore[union-attr]
    finally:
        store.close()
