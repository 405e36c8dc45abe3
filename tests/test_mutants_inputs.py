"""Input validation a mutation audit (2026-12-05, "inputs") found undefended: each test failed
with its mutant planted and passes without it.

- a model's tool call is checked against the tool's ``parameters`` schema keyword by keyword
  (``maximum``, ``minimum``, ``integer``, ``enum``, ``additionalProperties``, nested ``items``
  and ``properties``, ``maxLength``, a boolean is no ``number``): a call that breaks one is never
  run, and the model is told which value was wrong; a call exactly at a bound runs;
- an id has one spelling: a tree id or an effect id in upper-case hex is refused, never read as
  the same tree (it was reported as a corrupt store) or looked up as another effect;
- a free-form id may have 256 characters (257 is refused, storing nothing);
- a quota written with a misspelt member (``{"maximun": 3}``) is refused, never read as
  unlimited;
- the mailbox capacity counts every signal of a batch, not the batch as one;
- signals granted to a child are debited from what a host may still send its parent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import ScenarioError, validate_scenario
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.errors import AgentfoldError, EngineCode, InvalidInput, ResourceLimitExceeded
from agentfold.domain.events import TreeLimits
from agentfold.domain.ids import ChildKey, SignalID, TreeID
from agentfold.domain.interaction.toolset import prepare_arguments
from agentfold.domain.program import (
    ChildSpec,
    Complete,
    Continue,
    Descriptor,
    Pause,
    Program,
    Signal,
    SignalRequest,
    Step,
    start_child_effect,
)
from agentfold.domain.requests import Settlement
from tests.bad_input_programs import listener_program, pair_program
from tests.interaction.tools import RecordingTool, one_tool_round
from tests.kernel_programs import IMPL, JsonStrategy, config_digest

WAIT = 30.0

# ---------------------------------------------------------------------------
# A model's tool call is checked against the tool's parameters, keyword by keyword

FORECAST = {
    "type": "object",
    "required": ["city", "days"],
    "additionalProperties": False,
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["metric", "imperial"]},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}},
        "detail": {"type": "object", "properties": {"wind": {"type": "boolean"}}},
        "ratio": {"type": "number"},
    },
}

# (call id, arguments, what the error the model reads must say); each breaks one keyword.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("no-days", {"city": "Oslo"}, "missing required property 'days'"),
    ("days-fraction", {"city": "Oslo", "days": 1.5}, "$.days: expected integer"),
    ("days-below", {"city": "Oslo", "days": 0}, "$.days: less than minimum 1"),
    ("days-above", {"city": "Oslo", "days": 8}, "$.days: greater than maximum 7"),
    ("extra", {"city": "Oslo", "days": 2, "country": "NO"}, "unexpected property 'country'"),
    ("units", {"city": "Oslo", "days": 2, "units": "kelvin"}, "$.units: value is not one of"),
    ("hour-above", {"city": "Oslo", "days": 2, "hours": [3, 24]}, "$.hours[1]: greater than maximum 23"),
    ("hour-text", {"city": "Oslo", "days": 2, "hours": [3, "4"]}, "$.hours[1]: expected integer"),
    ("wind-text", {"city": "Oslo", "days": 2, "detail": {"wind": "yes"}}, "$.detail.wind: expected boolean"),
    ("ratio-bool", {"city": "Oslo", "days": 2, "ratio": True}, "$.ratio: expected number"),
    ("city-long", {"city": "x" * 13, "days": 2}, "$.city: longer than 12 characters"),
    # orjson alone read it as 1.8446744073709552e+19, which passed "integer" and reached the tool
    ("days-huge", {"city": "Oslo", "days": 2**64}, "integer at $.days exceeds 64 bits"),
]

# Calls exactly at every bound: each runs, with its arguments as the model sent them.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("low", {"city": "x" * 12, "days": 1, "hours": [0, 23], "units": "metric", "detail": {"wind": True}, "ratio": 0.5}),
    ("high", {"city": "Oslo", "days": 7, "hours": [], "units": "imperial", "ratio": 2}),
]


def test_a_tool_call_breaking_one_keyword_of_its_parameters_never_runs_and_the_model_is_told_why() -> None:
    tool = RecordingTool("forecast", FORECAST, "sunny")
    results = one_tool_round(tool, [(cid, args) for cid, args, _ in REFUSED] + ACCEPTED)
    # Only the calls at the bounds ran, with exactly their arguments.
    assert sorted(tool.ran, key=lambda a: a["days"]) == [args for _, args in ACCEPTED]
    for cid, _, said in REFUSED:
        text, is_error = results[cid]
        assert is_error and said in text, (cid, text)
    for cid, _ in ACCEPTED:
        assert results[cid] == ("sunny", False), (cid, results[cid])


def test_tool_arguments_are_read_exactly_a_key_written_twice_is_refused_not_the_last_one_taken() -> None:
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}}
    assert prepare_arguments('{"days": 1, "days": 7}', schema) == (None, "arguments: $ has the key 'days' twice")
    assert prepare_arguments('{"days": 18446744073709551617}', schema) == (None, "integer at $.days exceeds 64 bits")
    assert prepare_arguments('{"days": 7}', schema) == ({"days": 7}, None)


# ---------------------------------------------------------------------------
# An id has one spelling


def _contents(store: EventStore) -> tuple[Any, ...]:
    heads = sorted((h.tree_id, h.version, h.head_digest) for h in store.heads())
    return heads, store.max_notification_id()


def test_a_tree_id_in_upper_case_hex_is_refused_never_read_as_the_same_tree(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            tree_id = runtime.start(listener_program(), None, start_id="spelling").tree_id
            runtime.wait_idle(tree_id)
            upper = "tree:" + tree_id.hex.upper()
            assert upper != tree_id and upper.lower() == tree_id
            before = _contents(store)
            for read in (runtime.capture, runtime.status):
                with pytest.raises(InvalidInput) as caught:
                    read(upper)
                assert caught.value.code == "identity.invalid" and upper in caught.value.message
            with pytest.raises(InvalidInput) as caught:
                TreeID(upper)
            assert caught.value.code == "identity.invalid"
            assert _contents(store) == before
    finally:
        store.close()


def test_a_start_id_of_256_characters_is_accepted_and_one_of_257_refused_storing_nothing(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            longest = "s" * 256
            handle = runtime.start(listener_program(), None, start_id=longest)
            assert runtime.wait_idle(handle.tree_id).root.status == "paused"
            before = _contents(store)
            with pytest.raises(InvalidInput) as caught:
                runtime.start(listener_program(), None, start_id=longest + "s")
            assert caught.value.code == "identity.invalid" and "1-256" in caught.value.hint
            assert _contents(store) == before
            with pytest.raises(InvalidInput):
                SignalID("g" * 257)
    finally:
        store.close()


# ---------------------------------------------------------------------------
# A quota is {"maximum": n} (or n, or null): a misspelt member is no unlimited quota


def test_a_quota_with_a_misspelt_member_is_refused_never_read_as_unlimited() -> None:
    with pytest.raises(InvalidInput) as caught:
        Quota.from_json({"maximun": 3})
    assert caught.value.code == "budget.invalid" and "maximun" in caught.value.message
    with pytest.raises(InvalidInput) as caught:
        Budget.from_json({"steps": {"maximum": 3, "max": 1}})
    assert caught.value.code == "budget.invalid"
    assert Budget.from_json({"steps": {"maximum": 3}, "effects": 0}) == Budget.of(steps=3, effects=0)
    # A scenario's Delegate budget written that way is refused when the scenario loads, not run unlimited.
    doc = {
        "name": "boss",
        "model": {"responses": [{"finish_reason": "stop", "message": {"content": "done"}}]},
        "delegates": [
            {
                "name": "writer",
                "input_schema": {"type": "object"},
                "budget": {"steps": {"maximun": 3}},
                "scenario": {
                    "name": "writer",
                    "model": {"responses": [{"finish_reason": "stop", "message": {"content": "written"}}]},
                },
            }
        ],
    }
    with pytest.raises(ScenarioError) as refused:
        validate_scenario(doc)
    assert refused.value.message.startswith("$.delegates[0].budget: "), refused.value.message


# ---------------------------------------------------------------------------
# Signal admission: capacity counts every signal of a batch, and a child's grant is debited
# from the signals a host may still send


def _refused(runtime: Runtime, call: Callable[[], Any], error: type[AgentfoldError], code: str) -> AgentfoldError:
    before = _contents(runtime.store)
    with pytest.raises(AgentfoldError) as caught:
        call()
    assert type(caught.value) is error and caught.value.code == code, f"{type(caught.value).__name__}: {caught.value}"
    assert _contents(runtime.store) == before
    return caught.value


def test_the_mailbox_capacity_counts_every_signal_of_a_batch(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'signals.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(
                listener_program(), None, start_id="capacity", limits=TreeLimits(max_pending_signals=2)
            )
            pid = runtime.wait_idle(handle.tree_id).root_id
            three = [SignalRequest(SignalID(f"s{i}"), {"text": str(i)}) for i in range(3)]
            _refused(
                runtime, lambda: runtime.deliver_signals(pid, three), ResourceLimitExceeded, EngineCode.LIMIT_SIGNALS
            )
            assert runtime.deliver_signals(pid, three[:2])
            assert runtime.capture(handle.tree_id).root.pending_count == 2
    finally:
        store.close()


GRANT_SIGNALS = 2


class GrantsSignals(JsonStrategy):
    """Starts one child granted ``GRANT_SIGNALS`` signals, then listens (paused) for host input."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            spec = ChildSpec(ChildKey("granted"), self.child.ref, budget=Budget.of(signals=GRANT_SIGNALS))
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        return Step(len(window), Pause("listening"), {"phase": "listening"})


def test_signals_granted_to_a_child_are_no_longer_the_parents_to_admit(tmp_path: Path) -> None:
    # Budget 6 signals: the start's settlement took 1 and the child's grant 2, for good (even
    # if the child never uses them): a host may send 3 more, not 5.
    child = Program(Descriptor("inputs.grant.child"), _Done(), IMPL, config_digest("inputs.grant.child"))
    parent = Program(
        Descriptor("inputs.grant.parent", signal_schema={"type": "object"}),
        GrantsSignals(child),
        IMPL,
        config_digest("inputs.grant.parent"),
        children=(child,),
    )
    store = EventStore(f"sqlite:///{tmp_path / 'grant.db'}")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, None, start_id="grant", budget=Budget.of(signals=6))
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            assert (root.status, root.allocated.signals, root.accepted_signals) == ("paused", GRANT_SIGNALS, 1)
            pid = root.process_id
            assert runtime.deliver_signals(pid, [SignalRequest(SignalID(f"h{i}"), {}) for i in range(3)])
            _refused(
                runtime,
                lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("h3"), {})]),
                ResourceLimitExceeded,
                EngineCode.LIMIT_SIGNALS,
            )
            # Each counter where it belongs (two Steps, the one child start, the start's settlement
            # and 3 host signals): a usage with effects and signals swapped shows here.
            assert runtime.capture(handle.tree_id).root.usage == {"steps": 2, "effects": 1, "signals": 4}
    finally:
        store.close()


class _Done(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Complete({"done": True}))


def test_an_effect_id_in_upper_case_hex_is_refused_never_looked_up_as_another_id(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(pair_program(), None, start_id="effect-spelling")
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            unknown = root.unknown_effects()[0].effect_id
            upper = "effect:" + unknown.removeprefix("effect:").upper()
            assert upper != unknown
            before = _contents(store)
            with pytest.raises(InvalidInput) as caught:
                runtime.resolve_unknown_effect(upper, Settlement.succeeded(), process_id=root.process_id)
            assert caught.value.code == "identity.invalid" and "lowercase hex" in caught.value.hint
            assert _contents(store) == before
            assert [e.effect_id for e in runtime.capture(handle.tree_id).root.unknown_effects()] == [unknown]
    finally:
        store.close()
