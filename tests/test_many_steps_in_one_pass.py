"""A Program that takes more Steps without an Effect than one append holds.

The runtime appends at most ``MAX_EVENTS_PER_APPEND`` events at a time; an advance that stopped
there has more to do, and the owner line goes on with it. A tree's first append (its start) and
an activation (``recover``, adoption) stopped there too, and nothing went on: the run stayed
``running`` for good, at version 2049, without an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import MAX_EVENTS_PER_APPEND, Runtime
from agentfold.domain.ids import SignalID, WaitKey
from agentfold.domain.program import (
    Checkpoint,
    Complete,
    Continue,
    Descriptor,
    Program,
    Signal,
    SignalRequest,
    Step,
    Wait,
    wait_effect,
)
from tests.kernel_programs import IMPL, JsonStrategy, config_digest

TICKS = 3 * MAX_EVENTS_PER_APPEND // 2  # one Step, one event: more than two appends' worth


class Ticker(JsonStrategy):
    """``ticks`` Checkpoint Steps, no Effect; with ``wait_first``, only once a signal came."""

    def __init__(self, wait_first: bool) -> None:
        self.wait_first = wait_first

    def initial(self, input: Any) -> Any:
        return {"n": 0, "phase": "open" if self.wait_first else "ticking"}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "open":
            return Step(0, Continue((wait_effect(WaitKey("go")),)), {"phase": "opening"})
        if state["phase"] == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        if state["phase"] == "waiting":
            return Step(len(window), Checkpoint("ticks.started", {}), {"phase": "ticking"})
        if state["n"] >= TICKS:
            return Step(0, Complete({"ticks": state["n"]}))
        return Step(0, Checkpoint("ticks.tick", {"n": state["n"]}), {"n": state["n"] + 1})


def ticker(wait_first: bool = False) -> Program:
    name = "test.ticker.waits" if wait_first else "test.ticker"
    return Program(Descriptor(name), Ticker(wait_first), IMPL, config_digest(name))


def test_a_start_that_fills_more_than_one_append_runs_to_its_end(store_url: str) -> None:
    store = EventStore(store_url)
    program = ticker()
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {}, start_id="many-steps")
        result = handle.result(timeout=60)
        assert (result.status, result.output) == ("completed", {"ticks": TICKS})
    assert store.head(handle.tree_id).version > MAX_EVENTS_PER_APPEND + 1  # type: ignore[union-attr]
    store.close()


def test_an_activation_that_fills_more_than_one_append_runs_to_its_end(tmp_path: Path) -> None:
    """The run waits; its answer is admitted while nobody owns it; ``recover`` activates it,
    and everything the answer lets it do comes in that activation's advance."""
    store = EventStore(f"sqlite:///{tmp_path / 'activation.db'}")
    program = ticker(wait_first=True)
    with Runtime(store, Catalog([program])) as first:
        handle = first.start(program, {}, start_id="many-steps-later")
        wait_id = first.wait_idle(handle.tree_id, timeout=30).root.current_wait
        assert wait_id is not None
    with Runtime(store, Catalog([program]), adopt_on_admit=False) as host:
        host.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("go-1"), {}, wait_id)])
    assert store.head(handle.tree_id).version < 10  # type: ignore[union-attr]  # stored, not driven
    with Runtime(store, Catalog([program])) as second:
        second.recover(str(handle.tree_id))
        result = second.result(handle.tree_id, timeout=60)
        assert (result.status, result.output) == ("completed", {"ticks": TICKS})
    store.close()
