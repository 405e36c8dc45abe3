"""Mistakes in a user's own Program are that run's classified failure, never the owner's end
(found by a review of user-written Programs on the Python API; docs/concepts.md "Step").

A call's outcome is written in the same append as the Step that follows it. Before these
fixes, a Step the kernel's checks did not foresee (a bare Effect where a tuple belongs, a
policy function that raised, a wait id that is no text, a BaseException from decide), an
Effect built directly with a payload that is no JSON or too large, an error text holding a
lone surrogate, or an ``encode_state`` that failed at a snapshot stopped the owner line with
``engine.runtime.failed``: the succeeded call's outcome was lost (recovery recorded it
unknown, or made a ``same_identity`` call again), and a 20 MiB payload made the whole
history unreadable. Real SQLite files and PostgreSQL databases.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.canonical import normalize
from agentfold.domain.errors import AgentfoldError, Failure, FailureKind, InvalidInput
from agentfold.domain.events import EffectDeclared, EffectSettled, ProcessTerminated
from agentfold.domain.ids import ChildKey, TreeID
from agentfold.domain.kernel import Kernel
from agentfold.domain.program import (
    Checkpoint,
    ChildSpec,
    Complete,
    Continue,
    Descriptor,
    Effect,
    EffectPolicy,
    Fail,
    Program,
    Replay,
    Signal,
    Step,
    Target,
    Wait,
    dispatcher_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import IMPL, CallLog, JsonStrategy, config_digest

Decide = Callable[[Any, Sequence[Signal]], Step]


class _Strategy(JsonStrategy):
    def __init__(self, second: Decide) -> None:
        self.second = second

    def initial(self, input: Any) -> Any:
        return {"n": 0}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["n"] == 0:  # one call that succeeds, then the Step under test
            return Step(0, Continue((dispatcher_effect({"charge": 1}),)), {"n": 1})
        return self.second(state, window)


def _program(name: str, second: Decide, log: CallLog, *, policy: Any = None, strategy: Any = None) -> Program:
    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        log.record(effect_id=str(request.effect_id), payload=request.payload)
        return Settlement.succeeded({"charged": True})

    extra = {"policy": policy} if policy is not None else {}
    return Program(
        Descriptor(name), strategy or _Strategy(second), implementation_digest=IMPL,
        configuration_digest=config_digest(name), dispatcher=FunctionDispatcher(call), **extra,
    )


def _kinds(store: EventStore, tree_id: Any) -> list[Any]:
    return [r.event for r in store.read(tree_id)]


def _raise(exc: BaseException) -> Decide:
    def second(state: Any, window: Sequence[Signal]) -> Step:
        raise exc

    return second


def _policy_raising(effect: Effect) -> EffectPolicy:
    if effect.payload.get("charge") == 1:
        return EffectPolicy(Replay.SAME_IDENTITY)
    raise KeyError("replay")


MISTAKES: dict[str, tuple[Decide, Any, str, str, str]] = {
    # name: (the second Step, the policy, the code, the kind, text in the message)
    "a bare Effect in Continue": (
        lambda s, w: Step(len(w), Continue(dispatcher_effect({"charge": 2})), {"n": 2}),  # type: ignore[arg-type]
        None, "execution.transition.invalid", "contract", "Continue takes a tuple of Effects, not Effect"),
    "a policy function that raises": (
        lambda s, w: Step(len(w), Continue((dispatcher_effect({"charge": 2}),)), {"n": 2}),
        _policy_raising, "execution.effect.invalid", "contract", "policy for effect 0 failed: KeyError"),
    "a consumed count that is True (it was stored as true)": (
        lambda s, w: Step(True, Continue((dispatcher_effect({"charge": 2}),)), {"n": 2}),
        None, "execution.transition.invalid", "contract", "consumed True of a window of 1"),
    "a wait id that is no text": (
        lambda s, w: Step(len(w), Wait({"id": 1}), {"n": 2}),  # type: ignore[arg-type]
        None, "execution.transition.invalid", "contract", "the Step cannot be checked: TypeError"),
    "a checkpoint kind that is no text": (
        lambda s, w: Step(len(w), Checkpoint(7), {"n": 2}),  # type: ignore[arg-type]
        None, "execution.transition.invalid", "contract", "checkpoint kind 7 is not qualified"),
    "decide raising SystemExit": (
        _raise(SystemExit(3)), None, "execution.step.failed", "panic", "SystemExit: 3"),
    "decide raising KeyboardInterrupt on an owner thread (no Ctrl-C reaches one)": (
        _raise(KeyboardInterrupt()), None, "execution.step.failed", "panic", "KeyboardInterrupt"),
    "decide raising GeneratorExit": (
        _raise(GeneratorExit()), None, "execution.step.failed", "panic", "GeneratorExit"),
    "a policy function that calls sys.exit": (
        lambda s, w: Step(len(w), Continue((dispatcher_effect({"charge": 2}),)), {"n": 2}),
        lambda e: EffectPolicy() if e.payload.get("charge") == 1 else _raise(SystemExit("gave up"))(None, ()),
        "execution.effect.invalid", "contract", "policy for effect 0 failed: SystemExit: gave up"),
    "an Effect built directly with a set in its payload": (
        lambda s, w: Step(len(w), Continue((Effect(Target.DISPATCHER, {"tags": {1, 2}}),)), {"n": 2}),
        None, "execution.effect.invalid", "contract", "value of type set at $.tags is not JSON"),
    "an Effect built directly with NaN in its payload": (
        lambda s, w: Step(len(w), Continue((Effect(Target.DISPATCHER, {"amount": float("nan")}),)), {"n": 2}),
        None, "execution.effect.invalid", "contract", "non-finite number"),
    # Nothing else exercised the capability check (a review found it could be dropped unseen).
    "an Effect requiring a capability the process does not hold": (
        lambda s, w: Step(len(w), Continue((dispatcher_effect({"charge": 2}),)), {"n": 2}),
        lambda e: EffectPolicy(required_capabilities=("payments",) if e.payload.get("charge") == 2 else ()),
        "engine.capability.denied", "contract", "effect requires capabilities ['payments'] the process does not hold"),
    "an Effect whose target is a string": (
        lambda s, w: Step(len(w), Continue((Effect("dispatcher", {}),)), {"n": 2}),  # type: ignore[arg-type]
        None, "execution.effect.invalid", "contract", "an Effect's target is a Target, not 'dispatcher'"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_in_the_step_after_a_call_fails_the_run_and_keeps_the_calls_outcome(
    durable_store_url: str, tmp_path: Path, mistake: str
) -> None:
    second, policy, code, kind, text = MISTAKES[mistake]
    log = CallLog(tmp_path / "calls.jsonl")
    program = _program("mistake.prog", second, log, policy=policy)
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {}, start_id="mistake").result(timeout=30)
            assert result.status == "failed"
            assert result.termination is not None
            failure = result.termination["failure"]
            assert (failure["code"], failure["kind"]) == (code, kind), failure
            assert text in failure["message"], failure
        with Runtime(store, Catalog([program])) as again:
            assert again.recover() == []  # nothing left to drive
        stream = _kinds(store, TreeID.for_start("mistake"))
        (settled,) = [e for e in stream if isinstance(e, EffectSettled)]
        assert settled.status == "succeeded" and settled.payload == {"charged": True}
        assert sum(isinstance(e, EffectDeclared) for e in stream) == 1  # the mistaken Step declared nothing
        assert isinstance(stream[-1], ProcessTerminated)
        assert len(log.calls()) == 1  # made once, never again
    finally:
        store.close()


def test_a_policy_naming_its_replay_by_its_text_is_that_replay(store_url: str, tmp_path: Path) -> None:
    # EffectPolicy(replay="same_identity") was taken at first and then refused at the Step.
    log = CallLog(tmp_path / "calls.jsonl")

    def second(state: Any, window: Sequence[Signal]) -> Step:
        return Step(len(window), Complete({"ok": True}), {"n": 2})

    program = _program("mistake.policy", second, log, policy=lambda e: EffectPolicy("same_identity"))  # type: ignore[arg-type]
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="policy-text")
            assert handle.result(timeout=30).status == "completed"
            (declared,) = [e for e in _kinds(store, handle.tree_id) if isinstance(e, EffectDeclared)]
            assert declared.replay == "same_identity"
    finally:
        store.close()
    with pytest.raises(InvalidInput) as refused:
        EffectPolicy("sometimes")  # type: ignore[arg-type]
    assert refused.value.code == "effect.invalid"
    with pytest.raises(InvalidInput) as refused:
        EffectPolicy(required_capabilities="admin")  # type: ignore[arg-type]
    assert refused.value.code == "capabilities.invalid"


def test_an_effect_built_directly_over_the_size_limit_is_refused_and_the_history_stays_readable(
    durable_store_url: str, tmp_path: Path
) -> None:
    # A 20 MiB payload was stored as it was: every later read of the tree failed
    # (store.corrupt integrity.format), `show` and `audit verify` included.
    from agentfold.adapters.audit import verify_tree

    log = CallLog(tmp_path / "calls.jsonl")
    huge = "x" * (5 * 1024 * 1024)
    program = _program(
        "mistake.huge", lambda s, w: Step(len(w), Continue((Effect(Target.DISPATCHER, {"blob": huge}),)), {"n": 2}), log,
    )
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="huge")
            result = handle.result(timeout=60)
        assert result.status == "failed" and result.termination is not None
        assert result.termination["failure"]["code"] == "execution.effect.invalid"
        assert "above the limit of 4194304" in result.termination["failure"]["message"]
        loaded = store.load(handle.tree_id)
        assert loaded.state.root.status == "failed"
        check, _, _ = verify_tree(store, handle.tree_id, Catalog([program]))
        assert check.problems == []
    finally:
        store.close()


SURROGATE = b"report-\xff.csv".decode("utf-8", "surrogateescape")  # os.listdir's name of such a file


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


@pytest.mark.parametrize("raised", ["a lone surrogate", "a text that cannot be read"])
def test_a_dispatcher_error_whose_text_is_no_utf8_or_unreadable_is_an_unknown_outcome(
    durable_store_url: str, raised: str
) -> None:
    # The owner stopped (orjson: "str is not valid UTF-8"), or the dispatch thread died and
    # the call stayed in flight for good under a live owner.
    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        if raised == "a lone surrogate":
            raise OSError(f"cannot read {SURROGATE}")
        raise _Unprintable()

    program = Program(Descriptor("mistake.text"), _Strategy(lambda s, w: Step(len(w), Complete(None), {"n": 2})),
                      implementation_digest=IMPL, configuration_digest=config_digest("text"),
                      dispatcher=FunctionDispatcher(call))
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="text")
            state = runtime.wait_idle(handle.tree_id, timeout=30)
            (unknown,) = state.root.unknown_effects()
        (settled,) = [e for e in _kinds(store, handle.tree_id) if isinstance(e, EffectSettled)]
        assert settled.status == "unknown"
        expected = "cannot read report-\\udcff.csv" if raised == "a lone surrogate" else "_Unprintable whose text cannot be read"
        assert settled.diagnostic is not None and expected in settled.diagnostic.message, settled.diagnostic
        assert unknown.effect_id == settled.effect_id
    finally:
        store.close()


def test_a_failure_message_with_a_lone_surrogate_is_recorded_escaped(store_url: str, tmp_path: Path) -> None:
    log = CallLog(tmp_path / "calls.jsonl")

    def second(state: Any, window: Sequence[Signal]) -> Step:
        return Step(len(window), Fail(Failure(FailureKind.EXECUTION, "app.read_failed", f"cannot read {SURROGATE}")),
                    {"n": 2})

    program = _program("mistake.fail", second, log)
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {}, start_id="fail-text").result(timeout=30)
        assert result.status == "failed" and result.termination is not None
        assert result.termination["failure"] == {
            "kind": "execution", "code": "app.read_failed", "message": "cannot read report-\\udcff.csv"}
        assert len(log.calls()) == 1
    finally:
        store.close()


class _SetState(_Strategy):
    """Steps without Effects after its call, its state a set that ``encode_state`` cannot write."""

    def initial(self, input: Any) -> Any:
        return {"n": 0, "seen": set()}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["n"] == 0:
            return Step(0, Continue((dispatcher_effect({"charge": 1}),)), {"n": 1})
        if state["n"] < 40:
            return Step(len(window), Checkpoint("app.tick"), {"n": state["n"] + 1})
        return Step(len(window), Complete({"ok": True}), {"n": state["n"] + 1})

    def evolve(self, state: Any, facts: Any, consumed: Sequence[Signal]) -> Any:
        return {**state, **facts, "seen": state["seen"] | {facts["n"]}}


def test_an_encode_state_that_fails_skips_the_snapshot_not_the_append(durable_store_url: str, tmp_path: Path) -> None:
    # A snapshot is written in the append every `snapshot_every` events: encoding it raised
    # (TypeError: a set), the append failed, the owner stopped and the call's outcome was lost.
    log = CallLog(tmp_path / "calls.jsonl")
    program = _program("mistake.state", lambda s, w: Step(0, Complete(None), {}), log, strategy=_SetState(_raise(ValueError())))
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=10) as runtime:
            handle = runtime.start(program, {}, start_id="state")
            assert handle.result(timeout=30).status == "completed"
            assert runtime.capture(handle.tree_id).root.status == "completed"
        assert len(log.calls()) == 1
        (settled,) = [e for e in _kinds(store, handle.tree_id) if isinstance(e, EffectSettled)]
        assert settled.status == "succeeded"
    finally:
        store.close()


def test_a_start_whose_first_pass_fails_gives_its_lease_back(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing was stored, and the lease stayed held: every other runtime's start of this id was
    # refused (engine.start.in_progress) until this one closed.
    log_lock = threading.Lock()
    program = _program("mistake.lease", lambda s, w: Step(len(w), Complete(None), {"n": 2}), CallLog(tmp_path / "c"))
    real = Kernel.advance
    failed: list[bool] = []

    def advance(self: Kernel, *args: Any, **kwargs: Any) -> Any:
        with log_lock:
            if not failed:
                failed.append(True)
                raise RuntimeError("an internal failure")
        return real(self, *args, **kwargs)

    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            monkeypatch.setattr(Kernel, "advance", advance)
            with pytest.raises(RuntimeError):
                runtime.start(program, {}, start_id="lease")
            assert not runtime._leases.holds(TreeID.for_start("lease"))
            assert runtime.start(program, {}, start_id="lease").result(timeout=30).status == "completed"
    finally:
        store.close()


@dataclasses.dataclass
class _Order:
    amount: float


@pytest.mark.parametrize("value", [datetime.datetime(2026, 12, 4, 7, 0), uuid.UUID(int=7), _Order(3.5)])
def test_a_value_orjson_writes_its_own_way_is_stored_as_that_json_with_or_without_a_null(value: Any) -> None:
    # Such a value was stored as the JSON orjson writes for it, and refused (payload.invalid)
    # as soon as a null appeared anywhere in the same value (the walk looking for NaN ran then).
    alone = normalize({"when": value})
    beside_a_null = normalize({"when": value, "note": None})
    assert alone["when"] == beside_a_null["when"] == orjson.loads(orjson.dumps(value))
    # Given alone (a settlement's whole payload), it came back as the object itself: the live
    # decide saw it, any later fold the JSON (audit drift showed the difference).
    assert normalize(value) == orjson.loads(orjson.dumps(value)) and type(normalize(value)) in (str, dict)
    with pytest.raises(InvalidInput) as refused:
        normalize({"when": _Order(float("nan")), "note": None})
    assert refused.value.code == "payload.invalid" and "non-finite number at $.when.amount" in refused.value.message


@pytest.mark.parametrize(
    ("build", "code", "text"),
    [
        (lambda: Descriptor("p", output_schema={"$ref": "#/$defs/result"}), "schema.invalid",
         "unresolvable $ref '#/$defs/result' at #output (a $ref names a schema in this one"),
        (lambda: Descriptor("p", output_schema={"$ref": "#/required", "required": ["a"]}), "schema.invalid",
         "$ref '#/required' at #output does not name a schema (it names a list)"),
        (lambda: Descriptor("p", input_schema={"$defs": {"x": {"nope": 1}}, "$ref": "#/$defs/x"}), "schema.invalid",
         "unsupported schema keyword 'nope'"),
        (lambda: Descriptor("p", input_schema={"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}), "schema.invalid",
         "refers to itself without end"),  # checking a value against it never finished
        (lambda: Descriptor("p", input_schema={"const": b"x"}), "schema.invalid", "value of type bytes at $.const"),
        (lambda: Descriptor("p", input_schema={"enum": [{1, 2}]}), "schema.invalid", "value of type set at $.enum[0]"),
        (lambda: Descriptor("p", input_schema={"enum": [float("nan")]}), "schema.invalid", "non-finite number"),
        (lambda: Descriptor(None), "program.invalid", "descriptor name None is not a qualified name"),  # type: ignore[arg-type]
        # a description that is no text was accepted; a lone surrogate raised a bare TypeError at its digest
        (lambda: Descriptor("p", 5), "program.invalid", "the description of Program 'p' is int, not text"),  # type: ignore[arg-type]
        (lambda: Descriptor("p", "a\udc80"), "program.invalid", "is not valid UTF-8"),
        (lambda: Program(Descriptor("p"), JsonStrategy(), implementation_digest=IMPL,  # type: ignore[abstract]
                         configuration_digest=IMPL, children=("x",)),  # type: ignore[arg-type]
         "program.invalid", "children is a tuple of Programs"),
        (lambda: ChildSpec(ChildKey("k"), _program("p", _raise(ValueError()), CallLog(Path("/dev/null"))).ref,
                           capabilities="admin"),  # type: ignore[arg-type]
         "capabilities.invalid", "not 'admin'"),
    ],
)
def test_a_program_built_wrong_is_refused_when_it_is_built(build: Callable[[], Any], code: str, text: str) -> None:
    # Each raised a bare TypeError/AttributeError, or was accepted and failed the first run
    # that used it (an unresolvable $ref at completion: engine.runtime.failed), or (a child's
    # capabilities given as one string) granted the capabilities a, d, i, m, n.
    with pytest.raises(AgentfoldError) as refused:
        build()
    assert refused.value.code == code
    assert text in refused.value.message, refused.value.message


def test_a_recursive_local_ref_is_still_a_valid_schema() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
            "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    Descriptor("p", input_schema=tree)


def test_ctrl_c_in_a_starts_first_decide_reaches_the_caller_and_stores_nothing(store_url: str, tmp_path: Path) -> None:
    # A start's first pass runs on the caller's thread: Ctrl-C there is the operator's, not a
    # failure of the run (it was recorded as a `panic` and the run failed for good).
    class Interrupted(_Strategy):
        def decide(self, state: Any, window: Sequence[Signal]) -> Step:
            raise KeyboardInterrupt

    program = _program("mistake.ctrlc", _raise(ValueError()), CallLog(tmp_path / "c"), strategy=Interrupted(_raise(ValueError())))
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(KeyboardInterrupt):
                runtime.start(program, {}, start_id="ctrl-c")
            assert store.heads() == []
            assert not runtime._leases.holds(TreeID.for_start("ctrl-c"))
    finally:
        store.close()


class _Changes(_Strategy):
    """Builds its first Effect with dispatcher_effect(), then changes it (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__(lambda s, w: Step(len(w), Complete(None), {"n": 2}))
        self.how = how

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["n"] > 0:
            return self.second(state, window)
        effect = dispatcher_effect({"charge": 1})
        if self.how == "replaced":
            effect = dataclasses.replace(effect, payload={"charge": 1, "blob": "x" * (17 << 20)})
        else:  # changed in place: the check made when it was built no longer holds
            effect.payload["blob"] = "x" * (17 << 20)  # type: ignore[index]
        return Step(0, Continue((effect,)), {"n": 1})


@pytest.mark.parametrize("how", ["replaced", "changed in place"])
def test_an_effect_changed_after_it_was_built_never_makes_the_history_unreadable(
    durable_store_url: str, tmp_path: Path, how: str
) -> None:
    # dataclasses.replace() kept the mark "payload checked" and a payload changed in place kept
    # it too: 17 MiB were stored, and every later read of the tree failed (store.corrupt).
    program = _program("mistake.changed", _raise(ValueError()), CallLog(tmp_path / "c"), strategy=_Changes(how))
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            if how == "replaced":  # not marked: checked at the Step, which is refused
                result = runtime.start(program, {}, start_id="changed").result(timeout=60)
                assert result.termination is not None
                assert result.termination["failure"]["code"] == "execution.effect.invalid"
                assert store.load(TreeID.for_start("changed")).state.root.status == "failed"
            else:  # the store refuses to write what no reader would read back
                with pytest.raises(InvalidInput) as refused:
                    runtime.start(program, {}, start_id="changed")
                assert refused.value.code == "payload.too_large"
                assert store.heads() == []
    finally:
        store.close()


def test_an_expand_request_raising_an_unreadable_error_leaves_the_call_unknown(store_url: str, tmp_path: Path) -> None:
    # Its text was formatted on the owner line: the owner stopped (engine.runtime.failed) or the
    # first start raised a bare RuntimeError with the run stored and stuck.
    def expand(state: Any, payload: Any) -> Any:
        raise _Unprintable()

    base = _program("mistake.expand", lambda s, w: Step(len(w), Complete(None), {"n": 2}), CallLog(tmp_path / "c"))
    program = dataclasses.replace(base, expand_request=expand)
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="expand")
            assert len(runtime.wait_idle(handle.tree_id, timeout=30).root.unknown_effects()) == 1
        (settled,) = [e for e in _kinds(store, handle.tree_id) if isinstance(e, EffectSettled)]
        assert settled.status == "unknown" and settled.diagnostic is not None
        assert "cannot build the request: (_Unprintable whose text cannot be read)" in settled.diagnostic.message
    finally:
        store.close()


def test_a_number_whose_quotient_by_multiple_of_overflows_is_not_a_multiple(store_url: str, tmp_path: Path) -> None:
    # 1e308 against multipleOf 0.01: round() raised OverflowError out of the validator (a bare
    # error from start, the owner stopped on a host signal, a tool call's outcome unknown).
    base = _program("mistake.overflow", lambda s, w: Step(len(w), Complete(None), {"n": 2}), CallLog(tmp_path / "c"))
    schema = {"type": "object", "properties": {"amount": {"type": "number", "multipleOf": 0.01}}}
    program = dataclasses.replace(base, descriptor=Descriptor("mistake.overflow", input_schema=schema))
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, {"amount": 1e308}, start_id="overflow")
            assert refused.value.code == "engine.start.input_invalid"
            assert "$.amount: not a multiple of 0.01" in refused.value.message
            assert runtime.start(program, {"amount": 12.34}, start_id="fine").tree_id is not None
    finally:
        store.close()


class _StateWontEncode(_Strategy):
    def encode_state(self, state: Any) -> Any:
        raise ValueError("this state has no JSON form")


def test_show_reports_a_state_that_does_not_encode_instead_of_failing(
    durable_store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `agentfold show` (with the Program bound) ended with cli.internal; snapshots skip such a
    # state, and show now names the error where the state would be.
    from agentfold.adapters import cli
    from agentfold.adapters.sources import ProgramSources

    strategy = _StateWontEncode(lambda s, w: Step(len(w), Complete({"ok": True}), {"n": 2}))
    program = _program("mistake.show", _raise(ValueError()), CallLog(tmp_path / "c"), strategy=strategy)
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            assert runtime.start(program, {}, start_id="show-state").result(timeout=30).status == "completed"
    finally:
        store.close()
    capsys.readouterr()
    code = cli.main(["show", "show-state", "--store", durable_store_url, "--json"],
                    sources=ProgramSources(programs=(program,)))
    shown = orjson.loads(capsys.readouterr().out)
    assert code == 0
    (root,) = shown["processes"]
    assert root["status"] == "completed" and "state" not in root
    assert root["state_error"] == "encode_state failed: ValueError: this state has no JSON form"


def test_a_schema_whose_refs_form_a_dag_checks_a_value_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # Level i = anyOf of two refs to level i+1: no loop (check_schema takes it), but a wrong
    # value was checked along every path, 2^depth of them (an answer at depth 40 never finished;
    # 25 stays under the validator's nesting bound of 64 in-place steps).
    from agentfold.domain import json_schema

    depth = 25
    defs: dict[str, Any] = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]}
                            for i in range(depth)}
    defs[f"l{depth}"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/l0"}
    Descriptor("p", input_schema=schema)
    checked: list[int] = []
    once = json_schema._errors

    def counted(*args: Any) -> list[str]:
        checked.append(1)
        return once(*args)

    monkeypatch.setattr(json_schema, "_errors", counted)
    assert json_schema.schema_errors(5, schema) == ["$: matches none of anyOf"]
    assert json_schema.schema_errors("fine", schema) == []
    assert len(checked) < 10 * depth


def test_an_effect_requiring_a_capability_the_process_holds_runs(store_url: str, tmp_path: Path) -> None:
    log = CallLog(tmp_path / "calls.jsonl")

    def second(state: Any, window: Sequence[Signal]) -> Step:
        if state["n"] == 1:
            return Step(len(window), Continue((dispatcher_effect({"charge": 2}),)), {"n": 2})
        return Step(len(window), Complete({"ok": True}), {"n": 3})

    policy = lambda e: EffectPolicy(required_capabilities=("payments",) if e.payload.get("charge") == 2 else ())  # noqa: E731
    program = _program("mistake.capable", second, log, policy=policy)
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {}, start_id="capable", capabilities=("payments",))
            assert handle.result(timeout=30).status == "completed"
        declared = [e for e in _kinds(store, handle.tree_id) if isinstance(e, EffectDeclared)]
        assert [d.capabilities for d in declared] == [(), ("payments",)]
        assert len(log.calls()) == 2
    finally:
        store.close()
