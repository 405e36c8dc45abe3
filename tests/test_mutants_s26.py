"""Behaviour session 26 promised that no test defended (a mutation audit of 0fcb64b..dc7b79e).

Each test names the promise it proves; each failed with a planted bug the rest of the suite
let through (the report of the audit lists them):

- a host's outcome is checked by the Program before it is recorded (``check_resolution``):
  a hand-built tool input request and a hand-built context preparation are refused as the
  Tool child and the Interaction would refuse them, and a valid outcome is not refused (a
  model call of a Program with a context policy that changed nothing, a context preparation
  the host resolves as failed);
- counts the kernel computes are read strictly from stored events (``StrictCount``);
- the Python API's argument checks: every Budget quota, the Runtime's settings up to
  ``threading.TIMEOUT_MAX``, negative ``drain``/``close`` bounds that mean "do not wait"
  (an answer to the input of a run that ended in any way: tests/test_host_python.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import EffectResolved
from agentfold.domain.ids import EffectID
from agentfold.domain.interaction.settle import settle_prepared_context
from agentfold.domain.program import Program, Replay
from agentfold.domain.requests import EffectRequest, Settlement
from tests.interaction.test_resolution_checked import (
    FINAL,
    DownSummarizer,
    _helpers_outcome_completes,
    _parked,
    _refused,
    running,
    tool_program,
)
from tests.kernel_programs import chain_program
from tests.reduced_program import program as reduced_program
from tests.test_cli import ROOT, agentfold, ok
from tests.test_forged_histories import rewrite


def _resolved(store: EventStore, tree_id: Any, effect: EffectID) -> EffectResolved:
    [resolved] = [r.event for r in store.read(tree_id)
                  if isinstance(r.event, EffectResolved) and r.event.effect_id == effect]
    return resolved


def context_program() -> Program:
    return compile_interaction(InteractionConfig(
        name="test.mutants_context", model=ScriptedModel([FINAL]), context_processor=DownSummarizer(),
        max_model_calls=2))


# ---------------------------------------------------------------------------
# check_resolution: what it refuses, and what it must not refuse


def test_a_reduced_model_call_whose_policy_changed_nothing_is_resolved_with_the_requests_messages(
    tmp_path: Path,
) -> None:
    """A Program with a context policy whose policy left the messages as they were: the host
    says the model received exactly the request's messages, the helper records no replacement,
    and the Program's check must take that outcome (it rebuilds it with the request's messages)."""
    program = reduced_program()
    sent = [{"role": "user", "content": "what is up?"}]  # no system message: the policy drops nothing
    answer = {"finish_reason": "stop", "message": {"content": "all quiet"}}
    with running(tmp_path, program, "reduced.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": sent})
        Host(runtime).resolve(effect, model_response=answer, effective_messages=sent)
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed", result
        recorded = _resolved(store, handle.tree_id, effect).payload
        assert set(recorded["model_result"]) == {"response"}, recorded  # no replacement: nothing changed


def test_a_hand_built_tool_input_request_is_checked_as_the_tool_child_checks_it(tmp_path: Path) -> None:
    """A host may resolve a lost tool call as "it asked for input" (``input_request``): one the
    Tool child would fail the run on is refused before anything is recorded; a valid one opens
    the tool's pending input."""
    program = tool_program()
    with running(tmp_path, program, "input.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "look it up"}]})
        _refused(runtime, store, handle, effect,
                 Settlement.succeeded({"tool_result": {"input_request": {"prompt": "which one?"}}}),
                 "interaction.settlement.invalid", "exactly prompt, response_schema and state")
        _refused(runtime, store, handle, effect,
                 Settlement.succeeded({"tool_result": {"input_request": {
                     "prompt": "which one?", "response_schema": False, "state": None}}}),
                 "interaction.settlement.invalid", "accepts no answer")
        runtime.resolve_unknown_effect(effect, Settlement.succeeded({"tool_result": {"input_request": {
            "prompt": "which one?", "response_schema": {"type": "string"}, "state": None}}}))
        runtime.wait_idle(handle.tree_id)
        [pending] = Host(runtime).pending(str(handle.tree_id))
        assert pending.get("prompt") == "which one?", pending


def test_a_hand_built_context_preparation_outcome_is_refused_before_it_is_recorded(tmp_path: Path) -> None:
    """``Runtime.resolve_unknown_effect`` with a context preparation's outcome that is not what
    ``settle_prepared_context`` builds (an empty context, text where it stores text parts, the
    messages without their envelope) is refused, the store unchanged; the helper's completes."""
    program = context_program()
    with running(tmp_path, program, "context.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "hi"}]})
        _refused(runtime, store, handle, effect, Settlement.succeeded({"prepared_context": {"messages": []}}),
                 "interaction.settlement.invalid", "cannot be empty")
        _refused(runtime, store, handle, effect, Settlement.succeeded({"prepared_context": {"messages": [
            {"role": "user", "content": "hi (summarized)"}]}}), "interaction.settlement.invalid", "build it with them")
        _refused(runtime, store, handle, effect, Settlement.succeeded({"messages": [
            {"role": "user", "content": "hi (summarized)"}]}), "interaction.settlement.invalid",
            '{"prepared_context": {"messages": [...]}}')
        _helpers_outcome_completes(runtime, store, handle, program, effect, settle_prepared_context,
                                   [{"role": "user", "content": "hi (summarized)"}])


def test_a_context_preparation_the_host_resolves_as_failed_fails_the_run_with_its_error(tmp_path: Path) -> None:
    """``status="failed"`` is the host's documented way to fail a call: for a context preparation
    its output is the error, not a list of messages (it must not be refused as one)."""
    program = context_program()
    with running(tmp_path, program, "failed.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "hi"}]})
        # Its output is the failure's text (a docs walk found an empty list accepted as the
        # failure, the run then failing with a generic message), refused before anything is stored.
        before = store.load(handle.tree_id).state.version
        for output in ([], " ", {"messages": []}):
            with pytest.raises(InvalidInput) as refused:
                Host(runtime).resolve(effect, output=output, status="failed")
            assert refused.value.code == "host.resolution_invalid", refused.value
            assert "a failed context preparation is resolved with output: the failure's text" in refused.value.message
        assert store.load(handle.tree_id).state.version == before
        Host(runtime).resolve(effect, output="the summarizer is down for good", status="failed")
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "failed", result
        assert "interaction.host.failed" in str(result.termination), result.termination
        resolved = _resolved(store, handle.tree_id, effect)
        assert (resolved.status, resolved.payload) == ("failed", "the summarizer is down for good"), resolved


def test_a_replay_records_the_dispatchers_own_outcome_without_the_programs_resolution_check(
    tmp_path: Path,
) -> None:
    """``Program.check_resolution`` checks a host's outcome, not a replay's: a replay is the
    Program's own dispatcher called again, its side effect already made, and its definite
    outcome is recorded (were it refused after the call, the call would have been made for
    nothing and the Effect would stay unknown)."""
    calls: list[str | None] = []

    def flaky(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.attempt_id)
        if len(calls) == 1:
            raise ConnectionResetError("the connection dropped mid-request")
        return Settlement.succeeded({"value": 7})

    def hosts_may_not(program: Program, request: Any, status: Any, payload: Any) -> None:
        raise InvalidInput("test.resolution_refused", "only a replay may settle this call")

    program = dataclasses.replace(chain_program(flaky, replay=Replay.SAME_IDENTITY, name="test.mutants_replay"),
                                  check_resolution=hosts_may_not)
    with running(tmp_path, program, "replay.db") as (runtime, store):
        handle = runtime.start(program, {"n": 1}, start_id="replay-1")
        [effect] = list(runtime.wait_idle(handle.tree_id).unknown_ids)
        _refused(runtime, store, handle, effect, Settlement.succeeded({"value": 7}),
                 "test.resolution_refused", "only a replay")  # a host's outcome is checked
        assert runtime.replay_unknown_effect(effect).payload == {"value": 7}
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed" and result.output == {"total": 7, "effects": 1}, result
        resolved = _resolved(store, handle.tree_id, effect)
        assert (resolved.resolved_by, resolved.payload) == ("replay", {"value": 7}), resolved
    assert len(calls) == 2  # the call and its one replay


# ---------------------------------------------------------------------------
# Counts read strictly: a forged checkpoint step or declaration step


def test_a_checkpoint_or_declaration_step_forged_as_a_float_or_text_is_refused_at_import(tmp_path: Path) -> None:
    """``CheckpointCommitted.step`` and ``EffectDeclared.step`` are whole numbers as stored:
    pydantic's lax mode read ``2.0`` or ``"2"`` as 2, and a forged export imported."""
    source = f"sqlite:///{tmp_path / 'source.db'}"
    demo = ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"
    ok(agentfold("run", str(demo), "--start-id", "demo-1", "--json", store=source))
    exported = tmp_path / "demo-1.jsonl"
    ok(agentfold("export", "demo-1", "--out", str(exported), store=source))
    imported = ok(agentfold("import", str(exported), "--json", store=f"sqlite:///{tmp_path / 'intact.db'}"))
    assert "stream.event_invalid" not in imported.stdout + imported.stderr  # the export itself imports
    for topic, forge in (("CheckpointCommitted", float), ("EffectDeclared", str)):
        forged = tmp_path / f"forged-{topic}.jsonl"
        edited: list[int] = []

        def edit(position: int, event_topic: str, body: dict[str, Any], topic: str = topic, forge: Any = forge,
                 edited: list[int] = edited) -> None:
            if event_topic.endswith(":" + topic) and not edited:
                body["step"] = forge(body["step"])
                edited.append(position)

        rewrite(exported, forged, edit)
        assert edited, topic
        ran = agentfold("import", str(forged), "--json", store=f"sqlite:///{tmp_path / f'target-{topic}.db'}")
        assert ran.code != 0, (topic, ran.stdout)
        assert "stream.event_invalid" in ran.stdout + ran.stderr, (topic, ran.stdout, ran.stderr)
        assert f"position {edited[0]}" in ran.stdout + ran.stderr, (topic, edited, ran.stdout, ran.stderr)


def test_a_consumed_count_stored_as_true_by_an_earlier_release_still_imports_and_verifies(tmp_path: Path) -> None:
    """``StepCommitted.consumed`` stays lax when read: until 2026-12-04 the kernel stored a
    Strategy's ``Step(True, ...)`` as ``"consumed": true``, and such stores must still fold
    (docs/events.md; the counts the kernel computes itself are strict)."""
    source = f"sqlite:///{tmp_path / 'source.db'}"
    demo = ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"
    ok(agentfold("run", str(demo), "--start-id", "demo-1", "--json", store=source))
    exported = tmp_path / "demo-1.jsonl"
    ok(agentfold("export", "demo-1", "--out", str(exported), store=source))
    edited: list[int] = []

    def edit(position: int, event_topic: str, body: dict[str, Any]) -> None:
        if event_topic.endswith(":StepCommitted") and body.get("consumed") == 1 and not edited:
            body["consumed"] = True
            edited.append(position)

    older = tmp_path / "older.jsonl"
    rewrite(exported, older, edit)
    assert edited
    target = f"sqlite:///{tmp_path / 'target.db'}"
    ok(agentfold("import", str(older), "--json", store=target))
    verified = ok(agentfold("audit", "verify", "--all", "--json", store=target))
    assert "stream.event_invalid" not in verified.stdout, verified.stdout


# ---------------------------------------------------------------------------
# Python API arguments


@pytest.mark.parametrize("member", ["steps", "effects", "signals"])
def test_every_quota_of_a_budget_given_as_a_plain_number_is_refused_when_built(member: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        Budget(**{member: 5})  # type: ignore[arg-type]
    assert refused.value.code == "budget.invalid", refused.value
    assert f"{member} is a Quota" in refused.value.message, refused.value.message
    assert Budget.of(**{member: 5}) == Budget(**{member: Quota(5)})


@pytest.mark.parametrize("horizon", [float("nan"), float("inf"), -float("inf"), 1e10])
def test_a_wait_horizon_that_is_no_finite_instant_is_refused(tmp_path: Path, horizon: float) -> None:
    """docs/errors.md: ``wait_idle``'s ``horizon`` is a finite number of seconds up to
    ``threading.TIMEOUT_MAX`` (a ``time.monotonic()`` instant), else ``runtime.invalid``."""
    store = EventStore(f"sqlite:///{tmp_path / 'horizon.db'}")
    program = chain_program(name="test.mutants_horizon")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"n": 1}, start_id="h")
            assert run.result(timeout=30).status == "completed"
            with pytest.raises(InvalidInput) as refused:
                runtime.wait_idle(run.tree_id, 1, horizon=horizon)
            assert refused.value.code == "runtime.invalid" and "horizon" in refused.value.message, refused.value
    finally:
        store.close()


@pytest.mark.parametrize("setting", ["poll_interval", "cancel_grace", "adopt_orphans_every"])
def test_a_runtime_setting_above_threading_timeout_max_is_refused_when_built(tmp_path: Path, setting: str) -> None:
    """``cancel_grace=1e10`` was taken and overflowed a timer later (docs/errors.md: a setting
    above ``threading.TIMEOUT_MAX`` is ``runtime.invalid``)."""
    store = EventStore(f"sqlite:///{tmp_path / 'settings.db'}")
    try:
        with pytest.raises(InvalidInput) as refused:
            Runtime(store, Catalog([chain_program()]), **{setting: 1e10})  # type: ignore[arg-type]
        assert refused.value.code == "runtime.invalid" and setting in refused.value.message, refused.value
    finally:
        store.close()


def test_a_negative_drain_or_close_bound_means_do_not_wait(tmp_path: Path) -> None:
    """docs/errors.md: ``drain``'s and ``close``'s bound is any finite number of seconds (only the
    waits' bounds are from 0): below 0 they do not wait, and a finished run is still read."""
    store = EventStore(f"sqlite:///{tmp_path / 'drain.db'}")
    program = chain_program(name="test.mutants_drain")
    try:
        runtime = Runtime(store, Catalog([program]))
        run = runtime.start(program, {"n": 2}, start_id="done")
        assert run.result(timeout=30).status == "completed"
        assert runtime.drain(-1) is True  # nothing in flight
        runtime.close(-1)
        assert runtime.closed
        assert runtime.result("done", timeout=5).status == "completed"
    finally:
        store.close()
