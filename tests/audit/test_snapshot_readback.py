"""``audit verify`` reads the latest snapshot back as a load does, with the tree's Programs.

Found with the team strategy: a failed collaboration's state equalled the fold (so the
snapshot "matched") but its own ``decode_state`` refused it, so every load logged the
snapshot unreadable and folded from the first event, and ``audit verify`` said OK. A
snapshot a load cannot use is now a ``snapshot.mismatch`` finding that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentfold.adapters.audit import verify_tree
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.program import Descriptor, Program
from agentfold.domain.requests import Settlement
from tests.kernel_programs import IMPL, Chain, config_digest


class PickyChain(Chain):
    """A chain whose decode_state refuses the state its last Step reaches."""

    def decode_state(self, data: Any) -> Any:
        if data["done"] >= data["n"]:
            raise ValueError("this release cannot read a finished chain")
        return data


def _program(strategy: Chain, name: str) -> Program:
    return Program(Descriptor(name, input_schema={"type": "object"}), strategy, IMPL, config_digest(name),
                   dispatcher=FunctionDispatcher(lambda request, context: Settlement.succeeded({"value": 1})))


def _verify(tmp_path: Path, strategy: Chain) -> Any:
    program = _program(strategy, "test.picky")
    store = EventStore(f"sqlite:///{tmp_path / 'picky.db'}")
    try:
        runtime = Runtime(store, Catalog([program]), snapshot_every=1)
        try:
            handle = runtime.start(program, {"n": 3})
            assert handle.result(20).status == "completed"
        finally:
            runtime.close()
        check, _, _ = verify_tree(store, handle.tree_id, Catalog([program]))
    finally:
        store.close()
    return check


def test_a_snapshot_equal_to_the_fold_that_cannot_be_read_back_is_a_finding(tmp_path: Path) -> None:
    check = _verify(tmp_path, PickyChain())
    assert check.programs_bound and not check.ok
    [finding] = check.problems
    assert finding.rule == "snapshot.mismatch"
    assert "cannot be read back" in finding.detail and "cannot read a finished chain" in finding.detail


def test_a_snapshot_that_reads_back_verifies(tmp_path: Path) -> None:
    check = _verify(tmp_path, Chain())
    assert check.ok and check.problems == [], check.to_json()
