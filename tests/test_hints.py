"""Every refusal says what to do: docs/python.md promises each ``AgentfoldError`` a hint.

An audit ("a developer embeds agentfold from the docs") found these refusals with an empty
hint; each is provoked here through the API a developer calls, and its hint must name the
way out. Also: ``Host.answer`` on a wait the Program opened itself said "wait W is not a
pending tool input ... (its current wait is W)", which read as a contradiction; it now says
that W is the Program's own wait and how to answer it (``Runtime.deliver_signals``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import RandomIds, Runtime
from agentfold.domain.canonical import normalize, parse_json_text
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.ids import StartID
from agentfold.domain.kernel import Kernel
from agentfold.domain.program import Descriptor, Program, Signal, SignalRequest, Step
from tests.bad_input_programs import listener_program, two_waits_program
from tests.kernel_programs import IMPL, JsonStrategy, config_digest


class Picky(JsonStrategy):
    """A Program whose ``initial`` refuses its input."""

    def initial(self, input: Any) -> Any:
        raise ValueError("the order needs an 'sku'")

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:  # pragma: no cover - never started
        raise NotImplementedError


def refusal(call: Callable[[], object]) -> AgentfoldError:
    with pytest.raises(AgentfoldError) as caught:
        call()
    return caught.value


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    store = EventStore("memory:")
    try:
        with Runtime(store) as rt:
            yield rt
    finally:
        store.close()


def waiting(runtime: Runtime) -> tuple[Any, str]:
    """A run of a Program that waits on a wait it opened itself (not a tool's input)."""
    run = runtime.start(two_waits_program(), {}, start_id="two-waits")
    runtime.wait_idle(run.tree_id, timeout=10)
    wait = runtime.capture(run.tree_id).processes[run.root_process_id].current_wait
    assert wait is not None
    return run, wait


def test_a_start_the_programs_initial_refuses_says_to_fix_the_input(runtime: Runtime) -> None:
    picky = Program(Descriptor("test.picky"), Picky(), IMPL, config_digest("test.picky"))
    error = refusal(lambda: runtime.start(picky, {"qty": 1}, start_id="picky"))
    assert error.code == "engine.process.start.failed"
    assert "the order needs an 'sku'" in error.message
    assert "fix the input" in error.hint and "initial()" in error.hint


@pytest.mark.parametrize("start_id", [17, 1.5, b"bytes", ["a"]])
def test_a_start_id_that_is_not_text_says_to_pass_text(runtime: Runtime, start_id: Any) -> None:
    error = refusal(lambda: runtime.start(two_waits_program(), {}, start_id=start_id))
    assert error.code == "identity.invalid"
    assert error.hint == "pass the start id as text (a str), e.g. str(value)"
    assert refusal(lambda: StartID(start_id)).hint == error.hint


@pytest.mark.parametrize(("value", "words"), [
    ({"tags": {"a", "b"}}, "set to a list"),
    ({"ratio": float("nan")}, "no NaN or infinity"),
    ({"big": 1 << 70}, "as a string"),
    ({1: "x"}, "keys are strings"),
    ({"text": "\ud800"}, "lone surrogate"),
])
def test_a_value_that_is_not_json_says_how_to_make_it_json(runtime: Runtime, value: Any, words: str) -> None:
    error = refusal(lambda: runtime.start(two_waits_program(), value, start_id="not-json"))
    assert error.code == "payload.invalid"
    assert words in error.hint, error.hint


@pytest.mark.parametrize(("text", "words"), [
    ('{"a": 1,}', "RFC 8259"),
    ('{"a": NaN}', "no NaN or infinity"),
    ("[" * 300 + "]" * 300, "at most 128 levels"),
])
def test_json_text_that_is_not_json_says_what_to_send(text: str, words: str) -> None:
    error = refusal(lambda: parse_json_text(text, what="--output"))
    assert error.code == "payload.invalid"
    assert words in error.hint, error.hint


def test_deep_nesting_says_to_flatten() -> None:
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    error = refusal(lambda: normalize(deep))
    assert error.code == "payload.invalid" and "at most 128 levels" in error.hint


def test_an_unknown_control_lists_the_controls(runtime: Runtime) -> None:
    run, _ = waiting(runtime)
    kernel = Kernel(runtime.capture(run.tree_id), lambda ref: None, RandomIds())
    error = refusal(lambda: kernel.request_control(run.root_process_id, "stop"))
    assert error.code == "control.invalid"
    assert error.hint == "the controls are pause, resume, cancel, kill and deadline"


def test_unaddressed_input_while_waiting_says_to_answer_the_wait_first(runtime: Runtime) -> None:
    run, wait = waiting(runtime)
    error = refusal(lambda: runtime.deliver_signals(run.root_process_id, [SignalRequest("note-1", {"note": "x"})]))
    assert error.code == "engine.signal.rejected"
    assert f"answer wait {wait} first" in error.hint
    assert "Runtime.deliver_signals" in error.hint and "wait_id" in error.hint


def test_an_answer_to_a_wait_already_answered_says_where_to_look(runtime: Runtime) -> None:
    run, wait = waiting(runtime)
    assert runtime.deliver_signals(run.root_process_id, [SignalRequest("a-1", {"name": "Ada"}, wait)])
    runtime.wait_idle(run.tree_id, timeout=10)
    error = refusal(lambda: runtime.deliver_signals(run.root_process_id, [SignalRequest("a-2", {"name": "Bo"}, wait)]))
    assert error.code == "engine.signal.rejected" and "already answered" in error.message
    assert "read the run" in error.hint


def test_a_signal_outside_the_programs_signal_schema_names_the_schema(runtime: Runtime) -> None:
    run = runtime.start(listener_program(), {}, start_id="listener")
    runtime.wait_idle(run.tree_id, timeout=10)
    error = refusal(lambda: runtime.deliver_signals(run.root_process_id, [SignalRequest("s-1", {"nope": 1})]))
    assert error.code == "engine.signal.schema"
    assert "signal_schema" in error.hint


def test_host_answer_on_a_programs_own_wait_says_what_it_is_and_how_to_answer_it(runtime: Runtime) -> None:
    run, wait = waiting(runtime)
    host = Host(runtime)
    version = runtime.store.head(run.tree_id).version
    error = refusal(lambda: host.answer(run.root_process_id, wait, {"name": "Ada"}))
    assert error.code == "engine.signal.rejected"
    assert error.message.startswith(f"wait {wait} is a wait of the Program of process {run.root_process_id} "
                                    "(test.two_waits) itself, not a tool's input"), error.message
    assert "current wait is" not in error.message
    assert "deliver_signals" in error.hint and "SignalRequest(signal_id, payload, wait_id=wait_id)" in error.hint
    assert runtime.store.head(run.tree_id).version == version
    # The way the hint gives works.
    assert runtime.deliver_signals(run.root_process_id, [SignalRequest("answer-1", {"name": "Ada"}, wait_id=wait)])


def test_host_resolve_with_nothing_to_resolve_with_says_what_to_give(runtime: Runtime) -> None:
    from tests.test_resolution_status import charge

    run = runtime.start(charge(), {}, start_id="charge-hint")
    runtime.wait_idle(run.tree_id, timeout=10)
    host = Host(runtime)
    [unknown] = host.unknown(run.tree_id)
    for call in (lambda: host.resolve(unknown["effect_id"]),
                 lambda: host.resolve(unknown["effect_id"], output="x", disposition="failed")):
        error = refusal(call)
        assert error.code == "host.resolution_invalid"
        assert 'Host.unknown()' in error.hint and "model_response=" in error.hint and "output=" in error.hint


@pytest.mark.parametrize(("call", "words"), [
    (lambda host: host.unknown(limit=0), "at least 1"),
    (lambda host: host.pending(limit=-3), "at least 1"),
    (lambda host: host.unknown(after=7), "next_after"),
    (lambda host: host.unknown("some-run", limit=5), "drop"),
    (lambda host: host.runs(status="bogus"), "leave status out"),
    (lambda host: host.runs(limit=0), "at least 1"),
    (lambda host: host.runs(after="x"), "cursor of the last run"),
])
def test_a_bad_page_says_what_to_pass(runtime: Runtime, call: Callable[[Host], object], words: str) -> None:
    error = refusal(lambda: call(Host(runtime)))
    assert error.code == "host.page_invalid"
    assert words in error.hint, error.hint


class BadEffect(JsonStrategy):
    """A ``decide`` that raises a classified error: a payload that is not JSON, or JSON text
    with a key written twice (whose hint earlier releases recorded)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        from agentfold.domain.program import Continue, dispatcher_effect

        if self.kind == "duplicate":
            parse_json_text('{"a": 1, "a": 2}')
        return Step(0, Continue((dispatcher_effect({"at": object()}),)))


@pytest.mark.parametrize(("kind", "recorded"), [
    ("not-json", "InvalidInput: payload.invalid: value of type object at $.at is not JSON"),
    ("duplicate", "InvalidInput: payload.invalid: payload: $ has the key 'a' twice "
                  "(JSON parsers keep only the last one, silently; write each key once)"),
])
def test_a_recorded_failure_keeps_the_text_earlier_releases_recorded(runtime: Runtime, kind: str, recorded: str) -> None:
    """A ``decide`` that raised is recorded as the run's failure, in the error's text. A hint
    added since (a caller gets it) is not recorded: the history, and what ``audit drift``
    compares with it, must not change when advice is added or reworded; a hint earlier
    releases recorded still is. These texts are the ones release d6c9497 recorded."""
    with pytest.raises(AgentfoldError) as direct:
        normalize({"at": object()})
    assert direct.value.hint  # a caller gets the hint
    name = f"test.hints.bad_effect.{kind}"
    program = Program(Descriptor(name), BadEffect(kind), IMPL, config_digest(name))
    result = runtime.start(program, {}, start_id=f"bad-effect-{kind}").result(timeout=30)
    assert result.status == "failed" and result.termination is not None
    failure = result.termination["failure"]
    assert (failure["code"], failure["message"]) == ("execution.step.failed", recorded)
