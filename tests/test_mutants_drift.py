"""Drift and the settlement of tool calls (a mutation audit of the "drift" area, session 30).

docs/audit.md "audit drift": the current code re-decides every recorded Step and names
the first that differs; `ok` is false and the exit status 1 when it differs or cannot
fold the history at all. docs/interaction.md "Recovery" and docs/cli.md "resolve": a
host settles an unknown tool call with ``settle_tool_result``, which validates the
request against the exact ToolSet that made it and the outcome against the rules live
dispatch follows. Each test here failed with a planted bug (named in its docstring) and
passes without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.drift import find_drift
from agentfold.domain.errors import Failure, FailureKind, InvalidInput
from agentfold.domain.events import EffectResolved, ProcessTerminated
from agentfold.domain.interaction.settle import settle_tool_result
from agentfold.domain.program import Descriptor, Fail, Program, Signal, Step
from agentfold.domain.requests import EffectRequest, effect_request
from agentfold.domain.tree import fold_tree
from tests.audit.support import chain_sources, cli, record_chain
from tests.audit.test_drift import ShortcutDisagreesWithEvolve, same_ref, step_position
from tests.kernel_programs import IMPL, JsonStrategy, config_digest

# ---------------------------------------------------------------------------
# audit drift
# ---------------------------------------------------------------------------


class FailsAtOnce(JsonStrategy):
    """Its first Step ends the Process with a ``fail`` transition (a recorded decision)."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Fail(Failure(FailureKind.EXECUTION, "test.refused", "the order is refused")), {"phase": "failed"})


def test_an_unchanged_program_whose_step_failed_the_run_shows_no_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``fail`` Step records ``StepCommitted`` then ``ProcessTerminated``: one decision.
    Mutant: drift.find_drift marking only the decision's first event as compared
    (``covered = index + 1``): the ``ProcessTerminated`` of the same decision was taken as a
    decision of its own, re-decided, and the code that wrote the history "drifted" from it
    (exit 1): every run that failed by a Step could never pass the check."""
    program = Program(Descriptor("test.fails_at_once"), FailsAtOnce(), IMPL, config_digest("test.fails_at_once"))
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, None, start_id="refused-order")
            assert handle.result(timeout=20).status == "failed"
    finally:
        store.close()
    ran = cli(capsys, "audit", "drift", str(handle.tree_id), "--json", "--store", url, sources=chain_sources(program))
    assert ran.code == 0, (ran.stdout, ran.stderr)
    report = ran.json()
    assert (report["ok"], report["decisions"], report["first_drift"]) == (True, 1, None), report


def test_drift_that_cannot_fold_the_history_answers_not_ok_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/audit.md: ``ok`` is false when the current code cannot fold the history (``error``).
    Mutant: DriftReport.ok looking at ``drift`` only: the JSON said ``"ok": true`` next to a
    ``step.evolve`` error, so a deployment check reading ``ok`` let the new code take the run."""
    url = f"sqlite:///{tmp_path / 'chain.db'}"
    tree = str(record_chain(url, n=4))
    ran = cli(capsys, "audit", "drift", tree, "--json", "--store", url,
              sources=chain_sources(same_ref(ShortcutDisagreesWithEvolve())))
    assert ran.code == 1
    report = ran.json()
    assert report["error"] is not None and report["error"]["position"] == step_position(2), report
    assert report["ok"] is False, report


# ---------------------------------------------------------------------------
# Tool calls: what a tool's outcome may carry
# ---------------------------------------------------------------------------

FINAL = {"finish_reason": "stop", "message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]}}


def _asks(*names: str) -> dict[str, Any]:
    """A model response that calls each named tool once, with no arguments."""
    return {"finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "name": name, "arguments": "{}"} for i, name in enumerate(names, 1)]}}


class Lookup:
    """An ordinary tool; ``advertises`` is what its ``advertise`` returns after a success."""

    name = "lookup"
    description = "Looks something up."
    parameters: Any = {"type": "object"}

    def __init__(self, advertises: Sequence[str] = ()) -> None:
        self.advertises = list(advertises)
        self.calls = 0

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        self.calls += 1
        return ToolOutput.text("found it")

    def advertise(self, invocation: ToolInvocation, output: ToolOutput) -> list[str]:
        return self.advertises


class Secret:
    """A deferred tool."""

    name = "secret"
    description = "Only shown when advertised."
    parameters: Any = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        return ToolOutput.text("the secret")


def test_a_tool_that_advertises_an_ordinary_tool_fails_the_run_with_advertisement_invalid(tmp_path: Path) -> None:
    """docs/interaction.md "Deferred tools": advertising a name that is not a bound deferred
    tool fails the Tool child with ``interaction.tool.advertisement_invalid``, and with it the
    Interaction. Mutant: ToolCallStrategy.decide without that check: the Tool child
    completed, the name was silently dropped and the run went on to complete as if the
    tool had worked as declared."""
    model = ScriptedModel([_asks("lookup"), FINAL])
    program = compile_interaction(InteractionConfig(
        name="test.advertises_ordinary", model=model, tools=[Lookup(advertises=["lookup"])], deferred_tools=[Secret()]))
    store = EventStore(f"sqlite:///{tmp_path / 'adv.db'}")
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "look it up"}]})
            result = runtime.result(handle.tree_id, timeout=30)
    finally:
        store.close()
    assert result.status == "failed", result
    assert "interaction.tool.advertisement_invalid" in str(result.termination), result.termination


class LostLookup:
    """A tool whose call raises an error that is no ToolFailure: its outcome is unknown."""

    name = "lookup"
    description = "Looks something up."
    parameters: Any = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise RuntimeError("the lookup service dropped the connection")


@contextlib.contextmanager
def _one_unknown_tool_call(
    program: Program, text: str, db: Path
) -> Iterator[tuple[Runtime, EventStore, Any, Program, EffectRequest]]:
    """``program`` run on a SQLite file until its one tool call is left unknown: the runtime, its
    store, the run's handle, the ToolSet Program that owns the call and the call's retained request."""
    store = EventStore(f"sqlite:///{db}")
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": text}]})
            tree = runtime.wait_idle(handle.tree_id, timeout=30)
            [effect] = list(tree.unknown_ids)
            found = tree.find_effect(effect)
            assert found is not None
            owner = runtime.catalog.resolve(found[0].program)
            assert owner is not None
            yield runtime, store, handle, owner, effect_request(tree, found[0].process_id, effect, owner)
    finally:
        store.close()


def _resolved_tool_run(tmp_path: Path) -> tuple[Program, list[tuple[int, Any]]]:
    """A run whose one tool call ended unknown and was resolved by the host with the settle
    helper; the records of the completed run."""
    program = compile_interaction(InteractionConfig(
        name="test.drift_resolved", model=ScriptedModel([_asks("lookup"), FINAL]), tools=[LostLookup()]))
    with _one_unknown_tool_call(program, "look it up", tmp_path / "resolved.db") as (runtime, store, handle, owner,
                                                                                     request):
        runtime.resolve_unknown_effect(request.effect_id, settle_tool_result(owner, request, "found it (investigated)"))
        assert runtime.result(handle.tree_id, timeout=30).status == "completed"
        records = [(r.position, r.event) for r in store.read(handle.tree_id)]
    assert any(isinstance(e, EffectResolved) for _, e in records)
    return program, records


def test_an_older_history_with_inline_outputs_and_a_host_resolved_tool_call_shows_no_drift(tmp_path: Path) -> None:
    """docs/events.md: histories written before outputs were stored by reference hold the
    ``ProcessTerminated`` output inline, and ``audit drift`` compares outputs, not their storage
    form. Mutant: drift reading referenced outputs from ``EffectSettled`` only: the Tool child
    whose outcome a host resolved (``EffectResolved``) showed drift in its own output, so an
    older run that went through a host's resolution could never pass the check."""
    program, records = _resolved_tool_run(tmp_path)
    catalog = Catalog([program])
    assert find_drift(records, catalog.resolve).ok
    tree = fold_tree([e for _, e in records])
    by_ref = [i for i, (_, e) in enumerate(records) if isinstance(e, ProcessTerminated) and e.output_of is not None]
    resolved = {str(e.effect_id) for _, e in records if isinstance(e, EffectResolved)}
    assert any(str(records[i][1].output_of.effect_id) in resolved for i in by_ref), "no output refers to the resolution"
    old_form = list(records)
    for i in by_ref:
        position, event = old_form[i]
        old_form[i] = (position, event.model_copy(update={"output": tree.processes[event.process_id].output,
                                                           "output_of": None}))
    report = find_drift(old_form, catalog.resolve)
    assert report.ok, report.drift
    # The check still sees a different output in that form.
    position, event = old_form[by_ref[0]]
    old_form[by_ref[0]] = (position, event.model_copy(update={"output": {"disposition": "succeeded",
                                                                         "output": {"content": []}}}))
    drifted = find_drift(old_form, catalog.resolve)
    assert drifted.drift is not None and drifted.drift.path.startswith("ProcessTerminated.output"), drifted


# ---------------------------------------------------------------------------
# A host's settlement of an unknown tool call (settle_tool_result)
# ---------------------------------------------------------------------------


class LostSearch:
    """A tool with a required argument whose call ends unknown."""

    name = "search"
    description = "Searches."
    parameters: Any = {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise RuntimeError("the search service dropped the connection")


def _unknown_search_request(tmp_path: Path) -> tuple[Program, Any]:
    """The ToolSet Program and the retained request of a ``search`` call left unknown."""
    asks = {"finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "name": "search", "arguments": '{"q": "hotels"}'}]}}
    program = compile_interaction(InteractionConfig(
        name="test.search_lost", model=ScriptedModel([asks, FINAL]), tools=[LostSearch()]))
    with _one_unknown_tool_call(program, "find hotels", tmp_path / "search.db") as (_, _, _, owner, request):
        return owner, request


def _with_arguments(request: Any, arguments: str) -> Any:
    payload = request.payload
    call = {**payload["tool_call"]["invocation"]["call"], "arguments": arguments}
    return dataclasses.replace(request, payload={"tool_call": {**payload["tool_call"], "invocation": {"call": call}}})


def test_a_tool_call_whose_arguments_the_tool_does_not_admit_cannot_be_settled_as_a_result(tmp_path: Path) -> None:
    """docs/interaction.md "Recovery": the call must still be admitted by the binding (known
    tool, valid arguments). Such a call is rejected by the dispatcher without running; a crash
    before that rejection was stored leaves it unknown, and a host claiming it ran must be
    refused. Mutant: settle_tool_result ignoring the arguments' check: a result was built
    for a call the tool could never have run."""
    owner, request = _unknown_search_request(tmp_path)
    assert settle_tool_result(owner, request, "3 hotels").payload["tool_result"]["completion"]["disposition"] == (
        "succeeded")
    with pytest.raises(InvalidInput) as refused:
        settle_tool_result(owner, _with_arguments(request, '{"query": "hotels"}'), "3 hotels")
    assert refused.value.code == "interaction.settlement.invalid"
    assert "arguments are not admitted" in refused.value.message, refused.value.message


def test_a_call_an_older_release_ran_with_a_key_written_twice_can_still_be_settled(tmp_path: Path) -> None:
    """toolset.prepare_arguments: releases before 2026-12-05 read a call's arguments with orjson
    alone (the last of a key written twice wins) and ran such calls; this release's
    dispatcher refuses them, but an unknown outcome of one must stay resolvable, or its run
    can never finish. Mutant: settle_tool_result reading the arguments exactly (as the
    dispatcher does): the host's settlement of that call was refused."""
    owner, request = _unknown_search_request(tmp_path)
    older = _with_arguments(request, '{"q": "motels", "q": "hotels"}')
    settlement = settle_tool_result(owner, older, "3 hotels")
    assert settlement.payload == {"tool_result": {"completion": {
        "disposition": "succeeded", "output": {"content": [{"type": "text", "text": "3 hotels"}]}}}}


# ---------------------------------------------------------------------------
# The ToolSet: what the model is shown, and the Program's identity
# ---------------------------------------------------------------------------


class Described(Lookup):
    """The ``lookup`` tool with another description (a new release's wording)."""

    description = "Looks something up in the archive."


def test_a_tools_description_reaches_the_model_and_a_new_one_makes_another_program(tmp_path: Path) -> None:
    """docs/python.md "What to keep stable between deployments": the identity of an
    Interaction covers its tool definitions (names, descriptions, parameter schemas);
    "changing a schema, a description or a limit does" change it, so a run is never continued
    by code that shows the model other tools. Mutant: ToolSpec.definition() leaving the
    description out: the model never saw what the tool does, and a release that reworded it
    took up the runs of the older one under the same ProgramRef."""
    model = ScriptedModel([FINAL])
    program = compile_interaction(InteractionConfig(name="test.described", model=model, tools=[Lookup()]))
    store = EventStore(f"sqlite:///{tmp_path / 'described.db'}")
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "hi"}]})
            assert runtime.result(handle.tree_id, timeout=30).status == "completed"
    finally:
        store.close()
    [request] = model.requests
    assert [(t["name"], t["description"]) for t in request.tools] == [("lookup", "Looks something up.")]
    reworded = compile_interaction(InteractionConfig(name="test.described", model=ScriptedModel([FINAL]),
                                                     tools=[Described()]))
    assert reworded.ref != program.ref


def test_two_tools_bound_under_one_name_are_refused_when_the_interaction_is_built() -> None:
    """A call names its tool by name only: with two tools of one name, the model is shown both
    and one of them runs, whichever the lookup keeps. Mutant: ToolManifest without its "bound
    twice" check: the Interaction was built, and a deferred tool hidden from the model ran
    when the model called the ordinary tool of the same name."""

    class Hidden(Secret):
        name = "lookup"

    with pytest.raises(InvalidInput) as refused:
        compile_interaction(InteractionConfig(name="test.twice", model=ScriptedModel([FINAL]), tools=[Lookup()],
                                              deferred_tools=[Hidden()]))
    assert refused.value.code == "interaction.toolset.invalid"
    assert "'lookup' is bound twice" in refused.value.message, refused.value.message


def test_making_a_tool_a_direct_result_tool_makes_another_program() -> None:
    """docs/python.md: "a run is never continued by code that would decide differently". A
    direct-result tool ends the run with its result instead of going back to the model
    (docs/interaction.md "Direct results"): a run of the older build must not be taken up by
    the new one. Mutant: the configuration digests (of the Interaction and of its ToolSet)
    without ``direct_result``: both builds had one ProgramRef."""

    direct_lookup = Lookup()  # the same tool class (the same tool identity), now declared direct
    direct_lookup.direct_result = True  # type: ignore[attr-defined]
    ordinary = compile_interaction(InteractionConfig(name="test.direct", model=ScriptedModel([FINAL]),
                                                     tools=[Lookup()]))
    direct = compile_interaction(InteractionConfig(name="test.direct", model=ScriptedModel([FINAL]),
                                                   tools=[direct_lookup]))
    assert direct.strategy.definition.manifest.tool("lookup").direct_result  # type: ignore[attr-defined]
    assert direct.ref != ordinary.ref
