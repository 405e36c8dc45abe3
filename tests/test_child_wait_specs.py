"""A Step's wait_children Effect is refused unless its spec is what Scope's
ChildWaitCondition.Valid accepts: an integer quorum, given for condition ``quorum`` only.

``ChildWaitSpec.from_json`` (which the fold also reads stored payloads with) took ``"1"``,
``1.9`` or an ``any`` with a quorum of 5; a Step whose payload was built by hand went
through. The kernel now refuses it (the Process fails ``execution.effect.invalid``, a
contract failure) before anything of it is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import ChildKey
from agentfold.domain.program import (
    ChildSpec,
    Complete,
    Continue,
    Descriptor,
    Effect,
    Operation,
    Program,
    Signal,
    Step,
    Target,
    start_child_effect,
)
from tests.kernel_programs import IMPL, JsonStrategy, config_digest


class Done(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Complete({"done": True}))


class Waiter(JsonStrategy):
    """Starts two children, then waits for them with the spec members ``extra``."""

    def __init__(self, child: Program, extra: dict[str, Any]) -> None:
        self.child = child
        self.extra = extra

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            starts = tuple(start_child_effect(ChildSpec(ChildKey(k), self.child.ref)) for k in ("a", "b"))
            return Step(0, Continue(starts), {"phase": "started"})
        if phase == "started":
            kids = [s.payload["process_id"] for s in window[:2]]
            payload = {"operation": Operation.WAIT_CHILDREN.value, "key": "kids", "children": kids, **self.extra}
            return Step(2, Continue((Effect(Target.FRAMEWORK, payload),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Complete({"opened": True}), {"phase": "done"})
        raise RuntimeError(phase)


def run(url: str, extra: dict[str, Any], name: str) -> Any:
    child = Program(Descriptor("spec.child"), Done(), IMPL, config_digest("spec.child"))
    program = Program(Descriptor(name), Waiter(child, extra), IMPL, config_digest(name), children=(child,))
    with Runtime(EventStore(url), Catalog([program])) as runtime:
        handle = runtime.start(program, None)
        result = handle.result(timeout=30)
        return result, runtime.capture(handle.tree_id)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"condition": "quorum", "quorum": "1"}, "a quorum is an integer, not '1'"),
        ({"condition": "quorum", "quorum": 1.9}, "a quorum is an integer, not 1.9"),
        ({"condition": "quorum", "quorum": True}, "a quorum is an integer, not True"),
        ({"condition": "any", "quorum": 5}, "a quorum applies to condition quorum, not any"),
        ({"condition": "all", "quorum": 1}, "a quorum applies to condition quorum, not all"),
    ],
    ids=["text", "fraction", "bool", "any-with-quorum", "all-with-quorum"],
)
def test_a_wait_children_spec_scope_calls_invalid_fails_the_step_and_stores_no_wait(
    store_url: str, extra: dict[str, Any], message: str
) -> None:
    result, tree = run(store_url, extra, "spec.bad")
    assert result.status == "failed" and result.termination is not None
    failure = result.termination["failure"]
    assert (failure["kind"], failure["code"]) == ("contract", "execution.effect.invalid")
    assert message in failure["message"]
    assert not any(w.kind == "children" for w in tree.root.waits.values())


@pytest.mark.parametrize(
    "extra", [{"condition": "quorum", "quorum": 2}, {"condition": "any"}, {"condition": "all", "quorum": 0}]
)
def test_a_valid_spec_opens_its_wait(store_url: str, extra: dict[str, Any]) -> None:
    result, _ = run(store_url, extra, "spec.good")
    assert (result.status, result.output) == ("completed", {"opened": True})
