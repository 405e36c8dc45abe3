"""Tree limits are checked when a run starts: a negative count (every child start would then
be refused) or one too large to store was stored, or ended in a bare TypeError from the
encoder (found by the extremes audit). Now ``limits.invalid``, and nothing is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import TreeLimits
from agentfold.domain.ids import TreeID
from tests.kernel_programs import chain_program


@pytest.mark.parametrize("limits", [
    {"max_depth": -1}, {"max_active_children": -5}, {"max_children": -1}, {"max_pending_signals": -1},
    {"max_depth": 1 << 70}, {"max_tree_processes": 1 << 63},
])
def test_limits_out_of_range_are_refused_before_anything_is_stored(tmp_path: Path, limits: dict[str, Any]) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'limits.db'}")
    program = chain_program(name="test.limits")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, {"n": 1}, start_id="limits", limits=TreeLimits(**limits))
            assert refused.value.code == "limits.invalid"
            name = next(iter(limits))
            assert name in refused.value.message and refused.value.hint
            assert store.head(TreeID.for_start("limits")) is None  # type: ignore[arg-type]
            # zero and None are limits too (no children; no limit)
            ok = runtime.start(program, {"n": 1}, start_id="zero",
                               limits=TreeLimits(max_depth=0, max_children=None, max_pending_signals=1))
            assert ok.result(timeout=30).status == "completed"
            # No pending signal at all: not even an Effect's settlement (each Step reserves one per
            # Effect against the bound, spec 2.5 step 6), so the first Step that declares one fails.
            none = runtime.start(program, {"n": 1}, start_id="no-signals", limits=TreeLimits(max_pending_signals=0))
            failed = none.result(timeout=30)
            assert failed.status == "failed" and failed.termination is not None
            assert failed.termination["failure"]["code"] == "engine.limit.signals"
    finally:
        store.close()


@pytest.mark.parametrize("limits", [{"max_active_children": 4}, 16, "max_depth=2"])
def test_limits_that_are_not_tree_limits_are_refused_with_limits_invalid(tmp_path: Path, limits: Any) -> None:
    # A dict (the shape a JSON-minded caller reaches for) raised a bare AttributeError from
    # inside the runtime's start.
    store = EventStore(f"sqlite:///{tmp_path / 'limits.db'}")
    program = chain_program(name="test.limits")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, {"n": 1}, start_id="not-limits", limits=limits)
            assert refused.value.code == "limits.invalid"
            assert type(limits).__name__ in refused.value.message and "TreeLimits" in refused.value.hint
            assert store.head(TreeID.for_start("not-limits")) is None  # type: ignore[arg-type]
    finally:
        store.close()
