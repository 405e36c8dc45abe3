"""The 26 Interaction scenarios of the reference §11 (scope-interaction-team-agentrun.md).

Each test names the behaviour it proves and its §11 number; its docstring cites the
Scope test it follows and says where our event-sourced adaptation differs. Common
adaptations, said once here and repeated where they matter:

* "Snapshot restore" is a new :class:`Runtime` over the same store: the tree is folded
  again from its events, and a recovering owner appends ``WriterActivated`` (a new
  tree incarnation). Stores are real: memory and SQLite for most tests, SQLite and
  PostgreSQL (``durable_store_url``) where a restart or a crash is the point.
* A "lost acknowledgment" is an append that commits while its writer is told it
  failed (``support.lose_acknowledgement``); the old writer stops, a new one recovers.
  A cold recovery "without the old host" uses real process death
  (``CrashPlan`` + ``os._exit`` in ``tests/interaction/worker.py``).
* Go's ``ErrX`` sentinels are our ``AgentfoldError`` codes. Go's zero values have no
  counterpart: a ToolCallRef cannot be built invalid, and "no attribution" is a real
  value whose reference is None.
* Tools are real Python objects implementing ``agentfold.adapters.tools.Tool``; the model is
  ``ScriptedModel`` (wrapped by ``GatedModel`` to hold a call open).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchCancelled, DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction, steer_signal
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import RandomIds, RuntimeStopped, index_head, utc_now
from agentfold.adapters.scenario import scenario_catalog
from agentfold.adapters.tools import (
    ToolFailure,
    ToolInputRequired,
    ToolInvocation,
    ToolOutput,
    tool_invocation_from_request,
)
from agentfold.domain.budget import Budget
from agentfold.domain.errors import InvalidInput, NotFound, Rejected
from agentfold.domain.events import (
    EffectDeclared,
    EffectDispatched,
    EffectSettled,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import ChildKey, ProcessID, StartID
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.interaction.interaction import CompletionCandidate, CompletionDecision
from agentfold.domain.interaction.refs import ToolCallRef, delegate_child_key, tool_call_ref_of_child, tool_child_key
from agentfold.domain.interaction.settle import settle_model_result, settle_prepared_context, settle_tool_result
from agentfold.domain.interaction.state import InteractionState
from agentfold.domain.kernel import Kernel, start_tree
from agentfold.domain.program import Program, SignalRequest
from agentfold.domain.requests import Settlement, effect_request
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import delegate_attributions, pending_tool_inputs, run_summary, unknown_effects
from agentfold.projections.settled_results import ResultEntry, RoundResults, settled_results
from tests.interaction.support import (
    CRASH_EXIT,
    child_by_key,
    lose_acknowledgement,
    observe_appends,
    open_runtime,
    recover,
    request_of,
    settles_unknown,
    unknown_of,
    worker,
)
from tests.interaction.tools import (
    WAIT,
    CallLog,
    GatedModel,
    ProbeTool,
    call,
    chat_input,
    concurrent_any,
    final,
    keyed,
    keyed_parent,
    shape,
    text_of,
    tool_round,
    user,
    wait_until,
)

APPROVAL_SCHEMA = {
    "type": "object",
    "required": ["ok"],
    "properties": {"ok": {"type": "boolean"}},
    "additionalProperties": False,
}


# ---------------------------------------------------------------------------
# Builders


def interaction(model: Any, tools: list[Any] = (), name: str = "test.interaction", **options: Any) -> Program:  # type: ignore[assignment]
    return compile_interaction(InteractionConfig(name=name, model=model, tools=list(tools), **options))


def tool_program(program: Program) -> Program:
    tools = program.strategy.definition.tool_program  # type: ignore[attr-defined]
    assert tools is not None
    return tools  # type: ignore[no-any-return]


def asking(log: CallLog, name: str = "ask") -> ProbeTool:
    """A tool that asks for approval before it acts; its continuation reports the answer."""

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            raise ToolInputRequired({"question": "approve?"}, APPROVAL_SCHEMA, {"asked": invocation.call.id})
        answer = invocation.continuation.response
        return ToolOutput.text(f"approved={answer['ok']}", {"state": invocation.continuation.state})

    return ProbeTool(name, log, behave)


def failing(log: CallLog, name: str, message: str = "connection reset") -> ProbeTool:
    """A tool whose call raises an ordinary error: its outcome is unknown."""

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise RuntimeError(message)

    return ProbeTool(name, log, behave)


def failure_of(result: Any) -> dict[str, str]:
    assert result.termination is not None and result.termination["failure"] is not None, result
    return result.termination["failure"]  # type: ignore[no-any-return]


def tool_message_of(request: Any) -> dict[str, Any]:
    tools = [m for m in request.messages if m["role"] == "tool"]
    assert tools, request.messages
    return tools[-1]  # type: ignore[no-any-return]


def only_round(tree: Any) -> RoundResults:
    rounds = settled_results(tree)
    assert len(rounds) == 1, rounds
    return rounds[0]


# ---------------------------------------------------------------------------
# 1. SettledResults after cancellation


def test_i01_settled_results_of_a_cancelled_round_hold_only_the_definite_prefix(local_store_url: str) -> None:
    """Scope ``round_results_test.go`` TestSettledResultsReadsRecoveryFactsWithoutHistoryStorage.

    A three-call round with concurrency 2; call 0 finishes, calls 1 and 2 are held
    running and the host cancels the Interaction. The projection is one sparse round:
    index 0 only, call_count 3, not complete, references for 0..2 (none for 3), digest =
    sha256 of its exact JSON bytes, equal on every read and after folding the tree again
    from the store, immutable, and no model or tool call is repeated.
    Adaptation: the cancelled calls honour their DispatchContext and raise, so the
    kernel records them unknown (as Scope's cancelled Tool.Call); the "tree cut" is our
    folded TreeState, read from the live owner and again from the store by a new Runtime.
    """
    log = CallLog()
    fetch = ProbeTool("fetch", log, concurrency=concurrent_any)
    held = [fetch.hold("c1"), fetch.hold("c2")]
    model = ScriptedModel(
        [tool_round(call("c0", "fetch", {"i": 0}), call("c1", "fetch", {"i": 1}), call("c2", "fetch", {"i": 2})),
         final("never reached")]
    )
    program = interaction(model, [fetch], max_concurrent_tool_calls=2)
    store = EventStore(local_store_url)
    with open_runtime(store, program) as runtime:
        handle = runtime.start(program, chat_input("fetch three things"))
        for gate in held:
            assert gate.entered.wait(WAIT)
        assert runtime.cancel(handle.root_process_id)
        assert handle.result(WAIT).status == "canceled"
        tree = runtime.wait_idle(handle.tree_id)
        rounds = settled_results(tree)
    with open_runtime(store, program) as fresh:
        refolded = settled_results(fresh.capture(handle.tree_id))
    store.close()

    assert len(rounds) == 1
    r = rounds[0]
    assert (r.process_id, r.root_id, r.parent_id, r.child_key) == (handle.root_process_id, handle.root_process_id, None, None)
    assert r.model_call_sequence == 1 and r.call_count == 3 and not r.complete
    assert [(e.tool_call_index, e.call.id, e.disposition) for e in r.entries] == [(0, "c0", "succeeded")]
    assert [str(r.reference(i)) for i in range(3)] == [f"{handle.root_process_id}/1/{i}" for i in range(3)]
    assert r.reference(3) is None
    body = json.loads(r.json())
    assert list(body) == ["process_id", "root_id", "model_call_sequence", "call_count", "entries"]
    assert body["entries"][0] == {
        "tool_call_index": 0,
        "call": {"id": "c0", "name": "fetch", "arguments": '{"i": 0}'},
        "result": {"id": "c0", "name": "fetch", "output": {"content": [{"type": "text", "text": "fetch:c0"}],
                                                           "details": {"arguments": {"i": 0}}}},
        "disposition": "succeeded",
    }
    assert r.digest() == "sha256:" + hashlib.sha256(r.json()).hexdigest()
    # Deterministic: every read, and a fold of the stored events by another Runtime, agree.
    assert [x.json() for x in settled_results(tree)] == [r.json()]
    assert [x.json() for x in refolded] == [r.json()] and refolded[0].digest() == r.digest()
    # Immutable values.
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.call_count = 4  # type: ignore[misc]
    assert isinstance(r.entries, tuple)
    # The cancelled calls stay unknown evidence; nothing ran again.
    assert sorted(u["tool_call_ref"] for u in unknown_effects(tree)) == [str(r.reference(1)), str(r.reference(2))]
    assert {u["diagnostic"]["code"] for u in unknown_effects(tree)} == {"engine.dispatch.canceled"}
    assert len(model.requests) == 1
    assert sorted(log.started()) == ["c0", "c1", "c2"]
    summary = run_summary(tree)
    assert summary["status"] == "canceled" and summary["classification"] == "terminal"
    assert [p["status"] for p in summary["processes"]] == ["canceled", "completed", "canceled", "canceled"]


# ---------------------------------------------------------------------------
# 2-4. ToolCallRef


def test_i02_tool_call_ref_round_trips_as_text_json_and_dict_key_including_maximum_values() -> None:
    """Scope ``tool_call_ref_test.go`` TestToolCallRefCanonicalEncoding.

    Adaptation: Go's zero value has no Python counterpart; a ToolCallRef cannot be built
    with a zero sequence, a negative or overflowing index or an invalid process id, so an
    invalid reference can never be marshalled.
    """
    for text in ("process:parent/1/0", "process:parent/18446744073709551615/4294967295"):
        ref = ToolCallRef.parse(text)
        assert str(ref) == text and ref.to_json() == text
        assert ToolCallRef.parse(str(ref)) == ref and hash(ToolCallRef.parse(text)) == hash(ref)
        document = orjson.dumps({"ref": ref.to_json(), "by_ref": {str(ref): "item-7"}})
        decoded = orjson.loads(document)
        assert ToolCallRef.parse(decoded["ref"]) == ref
        restored = {ToolCallRef.parse(k): v for k, v in decoded["by_ref"].items()}
        assert restored[ref] == "item-7"
    top = ToolCallRef.parse("process:parent/18446744073709551615/4294967295")
    assert (top.process_id, top.model_call_sequence, top.tool_call_index) == ("process:parent", 2**64 - 1, 2**32 - 1)
    for args in (("process:p", 0, 0), ("process:p", 2**64, 0), ("process:p", 1, -1), ("process:p", 1, 2**32), ("", 1, 0)):
        with pytest.raises(InvalidInput):
            ToolCallRef(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "", "/1/0", "process:p/0/0", "process:p/1", "process:p/1/0/0", "process:p/01/0", "process:p/00/0",
        "process:p/1/00", "process:p/1/01", "process:p/+1/0", "process:p/-1/0", "process:p/1/+0", "process:p/1/-1",
        "process:p/18446744073709551616/0", "process:p/1/4294967296", " process:p/1/0", "process:p/1/0 ",
        "process:p/ 1/0", "process:p/1/0\n", "process:p/\uff11/0", "bad id/1/0", "process:p//0",
    ],
)
def test_i03_tool_call_ref_refuses_noncanonical_text(text: str) -> None:
    """Scope ``tool_call_ref_test.go`` TestToolCallRefRejectsNoncanonicalInput.

    Adaptation: "destination unchanged" holds because a ToolCallRef is frozen: a failed
    parse produces no value and leaves an existing one untouched.
    """
    existing = ToolCallRef.parse("process:keep/3/4")
    with pytest.raises(InvalidInput) as refused:
        ToolCallRef.parse(text)
    assert refused.value.code == "interaction.tool_call_ref.invalid"
    assert str(existing) == "process:keep/3/4"
    with pytest.raises(dataclasses.FrozenInstanceError):
        existing.tool_call_index = 5  # type: ignore[misc]


def test_i03_tool_call_ref_refuses_values_that_are_not_text() -> None:
    """Scope TestToolCallRefRejectsNoncanonicalInput (non-text input is Python's extra case)."""
    for value in (None, b"process:p/1/0", 7, ["process:p", 1, 0]):
        with pytest.raises(InvalidInput):
            ToolCallRef.parse(value)


def test_i04_reference_queries_report_none_without_a_tool_child_attribution(local_store_url: str) -> None:
    """Scope ``tool_call_ref_test.go`` TestReferenceQueriesRejectAbsentAttribution.

    A reference exists only where an Interaction gave it: a Tool child reads it from the
    ToolChildKey its parent chose. The same ToolSet program started under any other key
    gets none (its invocation's ``reference`` is None); a round reports none outside
    its calls; a Process that is not an Interaction has no Delegate attributions.
    Adaptation: Go's zero ToolInvocation/RoundResults/DelegateAttribution do not exist
    in Python; we query real values that lack the attribution instead.
    """
    parent = ProcessID("process:parent")
    assert tool_call_ref_of_child(None, None) is None
    assert tool_call_ref_of_child(parent, ChildKey("adapter.interaction")) is None
    for key in ("interaction.tool.0.0", "interaction.tool.01.0", "interaction.tool.1.01", "interaction.tool.1"):
        assert tool_call_ref_of_child(parent, ChildKey(key)) is None
    assert tool_call_ref_of_child(None, tool_child_key(1, 0)) is None
    assert tool_call_ref_of_child(parent, tool_child_key(2, 5)) == ToolCallRef(parent, 2, 5)
    empty_round = RoundResults(parent, parent, None, None, 1, 2, ())
    assert empty_round.reference(2) is None and empty_round.reference(-1) is None and not empty_round.complete

    log = CallLog()
    probe = ProbeTool("probe", log)
    tools = tool_program(interaction(ScriptedModel([]), [probe]))
    host = keyed_parent(tools, "custom.child", {"call": call("c1", "probe", {"x": 1})})
    with open_runtime(local_store_url, host) as runtime:
        handle = runtime.start(host, None)
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
    assert result.status == "completed" and result.output["output"]["disposition"] == "succeeded"
    assert [i.reference for i in log.invocations] == [None]
    assert log.invocations[0].relation.child_key == "custom.child"
    assert delegate_attributions(tree, handle.root_process_id) == ([], False)
    with pytest.raises(NotFound):
        delegate_attributions(tree, ProcessID("process:absent"))


# ---------------------------------------------------------------------------
# 5-8. Tool recovery


def _settles_tool_text(events: Any, text: str) -> bool:
    for e in events:
        if isinstance(e, EffectSettled) and e.status == "succeeded" and isinstance(e.payload, dict):
            done = e.payload.get("tool_result", {}).get("completion")
            if done and [p.get("text") for p in done["output"].get("content", [])] == [text]:
                return True
    return False


@pytest.mark.parametrize("concurrency", [1, 2])
def test_i05_tool_recovery_preserves_settled_siblings_after_lost_acknowledgment(
    durable_store_url: str, concurrency: int
) -> None:
    """Scope ``tool_recovery_test.go`` TestToolRecoveryPreservesIndependentSettlementsAfterLostAcknowledgment.

    Round [A, B, C] of one keyed tool: A and B use different resources, C the same as B.
    A succeeds; B's call raises (unknown); the append recording B's unknown outcome
    commits but its acknowledgement is lost, so the writer stops. A new Runtime over the
    same store recovers the tree: A is not called again, C has not run, invalid recovery
    inputs are refused; the host settles B with ``settle_tool_result`` and
    ``resolve_unknown_effect``; only then does C (same key as B) run; the model sees the
    results in call order. Concurrency 1 (one call per window) and 2 (A and B overlap).
    Adaptation: "lost acknowledgment" is our StoreFailure after a committed append
    (support.lose_acknowledgement), and restore is a new owner with WriterActivated.
    """
    log = CallLog()

    a_recorded: list[bool] = []

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.call.id == "B":
            # With concurrency 2, A and B run together: B fails once A's outcome is durable.
            wait_until(lambda: bool(a_recorded), "A's settlement to commit")
            raise ConnectionError("the connection dropped mid-call")
        return ToolOutput.text(f"fetch:{invocation.call.id}", {"resource": arguments["resource"]})

    fetch = ProbeTool("fetch", log, behave, concurrency=keyed(lambda args: args["resource"]),
                      parameters={"type": "object", "required": ["resource"]})
    model = ScriptedModel(
        [tool_round(call("A", "fetch", {"resource": "a"}), call("B", "fetch", {"resource": "b"}),
                    call("C", "fetch", {"resource": "b"})),
         final("all done")]
    )
    program = interaction(model, [fetch], max_concurrent_tool_calls=concurrency)
    other = interaction(ScriptedModel([]), [ProbeTool("fetch", CallLog(), description="another binding")], name="test.other")

    store = EventStore(durable_store_url)
    observe_appends(store, lambda events: a_recorded.append(True) if _settles_tool_text(events, "fetch:A") else None)
    lost = lose_acknowledgement(store, settles_unknown)
    with open_runtime(store, program) as first:
        handle = first.start(program, chat_input("fetch"))
        assert lost.wait(WAIT)
        with pytest.raises(RuntimeStopped):
            handle.result(WAIT)
    store.close()
    assert sorted(log.started()) == ["A", "B"]  # C (same key as B) has not run

    with open_runtime(durable_store_url, program, other) as runtime:
        recover(runtime, handle.tree_id)
        tree = runtime.wait_idle(handle.tree_id)
        assert tree.incarnation != tree.incarnations[0]
        unknown = unknown_of(runtime, tree)
        assert [(u["kind"], u["tool_call_ref"]) for u in unknown] == [("tool", f"{handle.root_process_id}/1/1")]
        assert log.count(call_id="A") == 1 and log.count(call_id="C") == 0
        round_now = only_round(tree)
        assert [(e.tool_call_index, e.disposition) for e in round_now.entries] == [(0, "succeeded")]

        request = request_of(runtime, tree, unknown[0]["process_id"], unknown[0]["effect_id"])
        assert request.attempt_id is None and request.payload["tool_call"]["invocation"]["call"]["id"] == "B"
        # Invalid recovery inputs are refused and change nothing.
        with pytest.raises(InvalidInput):
            settle_tool_result(tool_program(other), request, "b")  # a foreign ToolSet
        with pytest.raises(InvalidInput):
            settle_tool_result(tool_program(program), request, "b", disposition="maybe")
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, final("x"))  # a tool request is not a model call
        with pytest.raises(InvalidInput):
            runtime.resolve_unknown_effect(unknown[0]["effect_id"], Settlement.unknown())
        a_child = child_by_key(tree, "interaction.tool.1.0")
        a_effect = next(
            r.event.effect_id for r in runtime.store.read(handle.tree_id)
            if isinstance(r.event, EffectDeclared) and r.event.process_id == a_child.process_id
        )
        with pytest.raises((Rejected, NotFound)) as settled_already:
            runtime.resolve_unknown_effect(a_effect, settle_tool_result(tool_program(program), request, "b"))
        assert settled_already.value.code in ("engine.effect.not_pending", "engine.process.finished")
        assert log.count(call_id="C") == 0

        settlement = settle_tool_result(tool_program(program), request, {"content": ["fetch:B (investigated)"]})
        runtime.resolve_unknown_effect(unknown[0]["effect_id"], settlement)
        result = runtime.result(handle.tree_id, WAIT)

    assert result.status == "completed" and result.output["model_calls"] == 2
    assert [log.count(call_id=c) for c in "ABC"] == [1, 1, 1]
    assert log.started()[-1] == "C"
    results = tool_message_of(model.requests[1])["tool_results"]
    assert [r["id"] for r in results] == ["A", "B", "C"]
    assert [text_of(r["output"]) for r in results] == ["fetch:A", "fetch:B (investigated)", "fetch:C"]
    assert len(model.requests) == 2


def test_i06_recovered_direct_tool_completes_with_direct_results_from_the_exact_binding(local_store_url: str) -> None:
    """Scope ``tool_recovery_test.go`` TestToolRecoveryDerivesDirectPolicyFromExactBinding.

    A direct-result tool's call ends unknown. A settlement built for another ToolSet is
    refused, a failed result may not advertise deferred tools (nor may any result
    advertise a name that is not a bound deferred tool); the host's succeeded settlement
    makes the Interaction complete with DirectToolResults and no second model call: the
    direct policy comes from the binding, not from the recovery call.
    Adaptation: none beyond the common ones (the host resolves on the live owner).
    """
    log = CallLog()

    def lookup(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise TimeoutError("the upstream did not answer in time")

    tools = [ProbeTool("lookup", log, lookup, direct_result=True)]
    program = interaction(ScriptedModel([tool_round(call("d1", "lookup", {"q": "x"})), final("not expected")]), tools,
                          deferred_tools=[ProbeTool("secret", log)])
    foreign = interaction(ScriptedModel([]), [ProbeTool("lookup", CallLog(), description="other")], name="test.foreign")
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("look it up"))
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["diagnostic"]["code"] == "engine.dispatch.deadline"
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        with pytest.raises(InvalidInput, match="not by this program"):
            settle_tool_result(tool_program(foreign), request, "answer")
        with pytest.raises(InvalidInput, match="cannot advertise"):
            settle_tool_result(tool_program(program), request, "answer", "failed", ["secret"])
        with pytest.raises(InvalidInput, match="not a bound deferred tool"):
            settle_tool_result(tool_program(program), request, "answer", "succeeded", ["lookup"])
        runtime.resolve_unknown_effect(unknown["effect_id"], settle_tool_result(tool_program(program), request, "answer"))
        result = handle.result(WAIT)
    assert result.status == "completed"
    assert result.output == {
        "direct_tool_results": [{"id": "d1", "name": "lookup", "output": {"content": [{"type": "text", "text": "answer"}]}}],
        "model_calls": 1,
    }
    assert log.count("lookup") == 1 and log.count("secret") == 0


@pytest.mark.parametrize("disposition", ["succeeded", "failed", "rejected"])
def test_i07_reconciled_tool_result_equals_the_live_result_for_each_disposition(local_store_url: str, disposition: str) -> None:
    """Scope ``tool_recovery_test.go`` TestReconciledToolDispositionMatchesLiveOutcome.

    The same call settled live (a returned output, or a ToolFailure of that kind) and
    reconciled (the call's outcome unknown, then ``settle_tool_result`` with the same
    output and disposition) gives the same SettledResults entry. A second call that stays
    unknown keeps the round open so the entries can be read.
    Adaptation: the round is held open by a second unknown call instead of Scope's
    snapshot cut.
    """
    output = ToolOutput(("the outcome",), {"rows": 3})

    def live(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if disposition == "succeeded":
            return output
        raise ToolFailure(disposition, output, cause=ValueError("the business rule said no"))

    def lost(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise OSError("the outcome was not observed")

    def run(name: str, behave: Any) -> tuple[ResultEntry, list[int]]:
        log = CallLog()
        tools = [ProbeTool("subject", log, behave), failing(log, "gate")]
        model = ScriptedModel([tool_round(call("s", "subject", {"n": 1}), call("g", "gate")), final("x")])
        program = interaction(model, tools, name=name)
        with open_runtime(local_store_url, program) as runtime:
            handle = runtime.start(program, chat_input("go"))
            tree = runtime.wait_idle(handle.tree_id)
            unknown = unknown_of(runtime, tree)
            if unknown[0]["tool_call_ref"].endswith("/1/0"):
                request = request_of(runtime, tree, unknown[0]["process_id"], unknown[0]["effect_id"])
                runtime.resolve_unknown_effect(
                    unknown[0]["effect_id"],
                    settle_tool_result(tool_program(program), request, output.to_json(), disposition),
                )
                tree = runtime.wait_idle(handle.tree_id)
            entries = only_round(tree).entries
        assert [e.tool_call_index for e in entries] == [0]
        return entries[0], [log.count("subject"), log.count("gate")]

    live_entry, live_calls = run("test.live", live)
    reconciled_entry, reconciled_calls = run("test.reconciled", lost)
    assert live_entry.json_value() == reconciled_entry.json_value()
    assert live_entry.disposition == disposition
    assert live_entry.json_value()["result"].get("is_error", False) is (disposition != "succeeded")
    assert live_calls == reconciled_calls == [1, 1]


def _cold_scenario(tmp_path: Path) -> tuple[Path, Path]:
    effects = tmp_path / "effects.jsonl"
    doc = {
        "name": "cold-recovery",
        "input": {"messages": [{"role": "user", "content": "check the service"}]},
        "model": {
            "responses": [
                {"finish_reason": "tool_calls",
                 "message": {"tool_calls": [{"id": "call-1", "name": "lookup", "arguments": '{"q": "svc"}'}]}},
                {"finish_reason": "stop", "message": {"content": "service is up"}},
            ]
        },
        "tools": [{"name": "lookup", "parameters": {"type": "object"}, "result": {"output": "up"}}],
        "side_effect_log": str(effects),
    }
    path = tmp_path / "cold.json"
    path.write_text(json.dumps(doc))
    return path, effects


def test_i08_cold_recovery_from_durable_bytes_settles_model_and_tool_unknowns_without_replay(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Scope ``cold_recovery_test.go`` TestTypedRecoveryFromPersistedUnknownWithoutOldHost.

    Two runs die for real (``os._exit`` in a worker process): one inside the tool call
    (after its side effect), one inside the model call. This process recovers both from
    the store alone - the scenario Program is rebuilt from the document stored with the
    tree, no object of the dead host survives. The new owner appends WriterActivated
    with a new incarnation (the dead writer's incarnation is fenced); each in-flight
    effect is settled unknown (engine.dispatch.interrupted) without a call. The retained
    EffectRequest keeps the effect's identity; the tool one has reference (root,1,0);
    tool recovery refuses a model request and model recovery a tool request. Resolving
    completes each run; the tool ran once per run and model call 1 was never repeated.
    Adaptation: Scope restores a TreeSnapshot; we fold the event stream with a fresh
    Runtime whose catalog only knows how to rebuild scenario Programs.
    """
    scenario, effects = _cold_scenario(tmp_path)
    for start_id, point in (("cold-tool", "in-dispatch:2"), ("cold-model", "in-dispatch:1")):
        done = worker(durable_store_url, str(scenario), start_id, point)
        assert done.returncode == CRASH_EXIT, done.stderr
    assert len(effects.read_text().splitlines()) == 1  # the tool ran once, in the run that died inside it

    with open_runtime(durable_store_url, catalog=scenario_catalog()) as runtime:
        # --- the run that died inside its tool call
        recover(runtime, "cold-tool")
        tree_id = runtime.tree_of("cold-tool")
        tree = runtime.wait_idle(tree_id)
        root = tree.root.process_id
        stream = [r.event for r in runtime.store.read(tree_id)]
        started = stream[0]
        assert isinstance(started, TreeStarted)
        [activated] = [e for e in stream if isinstance(e, WriterActivated)]
        assert activated.previous_incarnation_id == started.incarnation_id != activated.incarnation_id
        assert tree.incarnation == activated.incarnation_id
        after = stream[stream.index(activated):]
        assert all(e.incarnation_id == activated.incarnation_id for e in after if isinstance(e, EffectDispatched))
        [unknown] = unknown_of(runtime, tree)
        assert unknown["kind"] == "tool" and unknown["tool_call_ref"] == f"{root}/1/0"
        assert unknown["diagnostic"]["code"] == "engine.dispatch.interrupted"
        declared = [e for e in stream if isinstance(e, EffectDeclared) and e.target == "dispatcher"]
        assert [e.effect_id for e in declared][1] == unknown["effect_id"]
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        assert (request.effect_id, request.step, request.index) == (declared[1].effect_id, declared[1].step, declared[1].index)
        assert request.attempt_id is None and request.relation.child_key == "interaction.tool.1.0"
        invocation = tool_invocation_from_request(request)
        assert invocation.reference == ToolCallRef(root, 1, 0) and invocation.call == ToolCall("call-1", "lookup", '{"q": "svc"}')
        program = runtime.catalog.resolve(tree.root.program)
        tools = runtime.catalog.resolve(request.program)
        assert program is not None and tools is not None
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, final("nope"))
        runtime.resolve_unknown_effect(unknown["effect_id"], settle_tool_result(tools, request, "up"))
        first = runtime.result(tree_id, WAIT)

        # --- the run that died inside its model call
        recover(runtime, "cold-model")
        model_tree_id = runtime.tree_of("cold-model")
        tree = runtime.wait_idle(model_tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["kind"] == "model" and unknown["tool_call_ref"] is None
        assert unknown["process_id"] == tree.root.process_id
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        assert request.payload["model_call"]["request"]["messages"] == [user("check the service")]
        with pytest.raises(InvalidInput):
            tool_invocation_from_request(request)
        with pytest.raises(InvalidInput):
            settle_tool_result(tools, request, "up")
        response = tool_round(call("call-1", "lookup", {"q": "svc"}))
        runtime.resolve_unknown_effect(unknown["effect_id"], settle_model_result(program, request, response))
        second = runtime.result(model_tree_id, WAIT)
        model = program.dispatcher.model

    for result in (first, second):
        assert result.status == "completed"
        assert result.output["model_response"]["message"]["content"][0]["text"] == "service is up"
    # No replay: one tool execution per run, and no model call 1 was made again here.
    assert len(effects.read_text().splitlines()) == 2
    assert [r.model_call_sequence for r in model.requests] == [2, 2]


# ---------------------------------------------------------------------------
# 9. Model recovery


def drop_system(messages: Any) -> list[dict[str, Any]]:
    """A local context policy: the model never sees system messages."""
    return [m for m in messages if m["role"] != "system"]


def test_i09_model_recovery_keeps_the_reduced_context_without_calling_the_model_again(local_store_url: str) -> None:
    """Scope ``model_recovery_test.go`` TestModelRecoveryPreservesEffectiveContextWithoutReplay.

    A context policy reduces what the model receives; the model call fails with an
    error, so its outcome is unknown. ``settle_model_result`` refuses a missing request,
    a missing or invalid response, missing or invalid effective messages (this program
    reduces its context, so the host must say what was sent) and a foreign program.
    Resolved with the response and the effective (reduced) messages, the working
    context becomes exactly those messages - durable, seen in the next model request -
    and model call 1 is never made again.
    Adaptation: Scope's ModelContextReducer is our ``context_policy``; the effective
    context is adopted as ``replacement_messages`` from the resolved settlement.
    """
    log = CallLog()
    probe = ProbeTool("probe", log)
    model = GatedModel([{"error": "HTTP 502 from the provider"}, final("done")], hold=[2])
    program = interaction(model, [probe], context_policy=drop_system)
    foreign = interaction(ScriptedModel([]), [ProbeTool("probe", CallLog())], name="test.foreign", context_policy=drop_system)
    messages = [{"role": "system", "content": "a long preamble"}, user("what is up?")]
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, {"messages": messages})
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["kind"] == "model" and unknown["diagnostic"]["code"] == "engine.dispatch.failed"
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        sent = [user("what is up?")]
        assert [m.messages for m in model.requests] == [tuple(sent)]  # the policy applied before the call
        response = tool_round(call("t1", "probe"))
        with pytest.raises(InvalidInput):
            settle_model_result(program, None, response, sent)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, None, sent)
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, response)  # effective messages missing
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, response, [])
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, {"finish_reason": "tool_calls"}, sent)
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, {**response, "finish_reason": "Not A Reason"}, sent)
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, response, [{"role": "robot", "content": "x"}])
        with pytest.raises(InvalidInput):
            settle_model_result(foreign, request, response, sent)
        runtime.resolve_unknown_effect(unknown["effect_id"], settle_model_result(program, request, response, sent))
        assert model.gates[2].entered.wait(WAIT)
        working = runtime.capture(handle.tree_id).root.state
        model.gates[2].release.set()
        result = handle.result(WAIT)
    assert isinstance(working, InteractionState)
    assert shape(working.messages) == [("user", "what is up?"), ("assistant", ["t1"]), ("tool", ["t1"])]
    assert result.status == "completed" and result.output["model_calls"] == 2
    assert [r.model_call_sequence for r in model.requests] == [1, 2] and model.calls == 2
    assert shape(model.requests[1].messages) == shape(working.messages)
    assert log.count("probe") == 1


class _Summarizer:
    """A context processor (external work in Scope terms) whose first call is lost."""

    def __init__(self) -> None:
        self.calls = 0

    def prepare_context(self, request: Any) -> list[dict[str, Any]]:
        self.calls += 1
        raise ConnectionError("the summarizer went away")


def test_i09_prepared_context_recovery_never_reruns_the_processor_and_feeds_the_model(local_store_url: str) -> None:
    """Scope ``model_recovery_test.go`` (SettlePreparedContext, the same recovery rule).

    A context processor's call ends unknown; ``settle_prepared_context`` refuses invalid
    or empty messages and a request that is not a context preparation; resolved with the
    investigated messages, the model receives exactly them and the processor is not
    called again.
    Adaptation: our context preparation is its own dispatcher Effect (``prepare_context``).
    """
    processor = _Summarizer()
    model = ScriptedModel([final("short answer")])
    program = interaction(model, context_processor=processor)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("a very long history", "the question"))
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["kind"] == "context"
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        with pytest.raises(InvalidInput):
            settle_prepared_context(program, request, [])
        with pytest.raises(InvalidInput):
            settle_prepared_context(program, request, [{"role": "user"}])
        with pytest.raises(InvalidInput):
            settle_model_result(program, request, final("x"), [user("x")])
        summary = [user("summary: the question")]
        runtime.resolve_unknown_effect(unknown["effect_id"], settle_prepared_context(program, request, summary))
        result = handle.result(WAIT)
    assert result.status == "completed" and result.output["model_calls"] == 1
    assert processor.calls == 1
    assert [list(r.messages) for r in model.requests] == [summary]


# ---------------------------------------------------------------------------
# 10. Input waits across restore


def test_i10_tool_input_wait_restores_without_repeating_the_settled_prefix(durable_store_url: str) -> None:
    """Scope ``checkpoint_test.go`` TestToolCheckpointRestoresWithoutRepeatingSettledPrefix.

    Round [prefix, ask]: the prefix tool completes, ``ask`` asks for approval and the
    tree parks. A new Runtime over the same store reads the pending input; a
    schema-invalid answer is refused locally and by the kernel (the wait stays open);
    an answer addressed to another wait is refused; the valid answer completes the run;
    re-sending it is not accepted twice; the prefix ran once; an answer after the Tool
    child finished is refused with engine.process.finished.
    Adaptation: restore = a new Runtime (it takes ownership when the answer is admitted,
    appending WriterActivated); ErrProcessFinished is the code engine.process.finished.
    """
    log = CallLog()
    model = ScriptedModel([tool_round(call("p", "prefix"), call("a", "ask")), final("done")])
    program = interaction(model, [ProbeTool("prefix", log), asking(log)])
    with open_runtime(durable_store_url, program) as first:
        handle = first.start(program, chat_input("deploy"))
        parked = first.wait_idle(handle.tree_id)
        assert parked.classification() == "parked"
    with open_runtime(durable_store_url, program) as runtime:
        tree = runtime.capture(handle.tree_id)
        [pending] = pending_tool_inputs(tree)
        assert pending.prompt == {"question": "approve?"} and pending.response_schema == APPROVAL_SCHEMA
        assert pending.reference == ToolCallRef(handle.root_process_id, 1, 1)
        assert tree.processes[pending.process_id].child_key == "interaction.tool.1.1"
        with pytest.raises(InvalidInput) as local:
            pending.response_signal("answer-bad", {"ok": "yes"})
        assert local.value.code == "engine.signal.schema"
        with pytest.raises(InvalidInput):
            runtime.deliver_signals(pending.process_id, [SignalRequest("answer-bad", {"input_response": {"ok": "yes"}},
                                                                       pending.wait_id)])
        root_wait = tree.root.current_wait
        assert root_wait is not None and root_wait != pending.wait_id
        with pytest.raises(Rejected) as wrong_wait:
            runtime.deliver_signals(pending.process_id, [SignalRequest("answer-x", {"input_response": {"ok": True}},
                                                                       root_wait)])
        assert wrong_wait.value.code == "engine.signal.rejected"
        assert [p.wait_id for p in pending_tool_inputs(runtime.capture(handle.tree_id))] == [pending.wait_id]
        answer = pending.response_signal("answer-1", {"ok": True})
        assert runtime.deliver_signals(pending.process_id, [answer]) is True
        result = runtime.result(handle.tree_id, WAIT)
        assert runtime.deliver_signals(pending.process_id, [answer]) is False  # the same answer: not accepted twice
        with pytest.raises(Rejected) as stale:
            runtime.deliver_signals(pending.process_id, [pending.response_signal("answer-2", {"ok": False})])
        assert stale.value.code == "engine.process.finished"
    assert result.status == "completed"
    assert log.count("prefix") == 1 and log.count("ask") == 2
    results = tool_message_of(model.requests[1])["tool_results"]
    assert [(r["id"], text_of(r["output"])) for r in results] == [("p", "prefix:p"), ("a", "approved=True")]


# ---------------------------------------------------------------------------
# 11-16. Steering


def test_i11_steer_queued_during_a_tool_input_wait_survives_restore_and_follows_the_tool_message(
    durable_store_url: str,
) -> None:
    """Scope ``steer_input_test.go`` TestSteerQueuedDuringChildWaitSurvivesRestore.

    While a Tool child waits for input, a steer to the Interaction is admitted but does
    not release the wait (the tool still waits, the tree stays parked). After a restart
    the same steer is not accepted twice; the answer completes the batch and the next
    model request holds the assistant message, the tool message, then the steer.
    Adaptation: restore = a new Runtime over the same store.
    """
    log = CallLog()
    model = ScriptedModel([tool_round(call("a", "ask")), final("done")])
    program = interaction(model, [asking(log)])
    steer = steer_signal("steer-1", user("use the newer requirements"))
    with open_runtime(durable_store_url, program) as first:
        handle = first.start(program, chat_input("deploy"))
        first.wait_idle(handle.tree_id)
        assert first.deliver_signals(handle.root_process_id, [steer]) is True
        tree = first.wait_idle(handle.tree_id)
        assert tree.classification() == "parked" and tree.root.status == "waiting"
        assert len(pending_tool_inputs(tree)) == 1 and len(model.requests) == 1
    with open_runtime(durable_store_url, program) as runtime:
        assert runtime.deliver_signals(handle.root_process_id, [steer]) is False
        [pending] = pending_tool_inputs(runtime.capture(handle.tree_id))
        runtime.deliver_signals(pending.process_id, [pending.response_signal("answer-1", {"ok": True})])
        result = runtime.result(handle.tree_id, WAIT)
    assert result.status == "completed" and result.output["model_calls"] == 2
    second = model.requests[1]
    assert shape(second.messages) == [("user", "deploy"), ("assistant", ["a"]), ("tool", ["a"]),
                                      ("user", "use the newer requirements")]
    assert second.applied_steer_signal_ids == ("steer-1",) and model.requests[0].applied_steer_signal_ids == ()


def test_i12_steer_admitted_while_the_round_enters_its_wait_is_applied_after_the_answer(local_store_url: str) -> None:
    """Scope ``steer_input_test.go`` TestSteerAdmittedDuringWaitStepSurvivesToolInput.

    Two steers arrive while the Interaction goes from its model result into waiting for
    its Tool child: one during the model call (consumed by the Steps that lead into the
    wait), one from inside the tool call, when the Interaction already waits. Both stay
    pending through the input wait and are applied, in arrival order, only to the model
    request after the answer: applied ids are exactly [steer-model, steer-tool].
    Adaptation: our owner commits the model result, the round admission and the Step
    that enters Waiting in one append, so "during the Step that enters Waiting" is
    reached by admitting the steers concurrently with that append (from the model and
    tool dispatch threads).
    """
    log = CallLog()
    model = GatedModel([tool_round(call("a", "ask")), final("done")])
    holder: dict[str, Any] = {}

    def steer_from_model(request: Any) -> None:
        if request.model_call_sequence == 1:
            holder["runtime"].deliver_signals(request.process_id, [steer_signal("steer-model", user("steer one"))])

    ask = asking(log)
    inner = ask.behave

    def ask_then_steer(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            holder["runtime"].deliver_signals(invocation.relation.parent_id, [steer_signal("steer-tool", user("steer two"))])
        return inner(invocation, arguments)

    ask.behave = ask_then_steer
    model.on_call = steer_from_model
    program = interaction(model, [ask])
    with open_runtime(local_store_url, program) as runtime:
        holder["runtime"] = runtime
        handle = runtime.start(program, chat_input("deploy"))
        tree = runtime.wait_idle(handle.tree_id)
        [pending] = pending_tool_inputs(tree)
        assert tree.root.status == "waiting" and len(model.requests) == 1
        runtime.deliver_signals(pending.process_id, [pending.response_signal("answer-1", {"ok": True})])
        result = handle.result(WAIT)
    assert result.status == "completed"
    assert model.requests[1].applied_steer_signal_ids == ("steer-model", "steer-tool")
    assert shape(model.requests[1].messages) == [("user", "deploy"), ("assistant", ["a"]), ("tool", ["a"]),
                                                 ("user", "steer one"), ("user", "steer two")]


def test_i13_steer_during_a_model_call_reaches_only_the_next_model_call(local_store_url: str) -> None:
    """Scope ``steer_test.go`` TestSteerDuringModelCallIsVisibleOnlyToNextModelCall.

    A steer admitted while the model is answering does not change that in-flight request;
    the model's final draft becomes context (assistant, then the steer) and a second
    model call answers instead of completing with the draft.
    Adaptation: none beyond the common ones.
    """
    model = GatedModel([final("draft"), final("revised")], hold=[1])
    program = interaction(model)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("write it"))
        assert model.gates[1].entered.wait(WAIT)
        assert runtime.deliver_signals(handle.root_process_id, [steer_signal("s1", user("make it shorter"))])
        model.gates[1].release.set()
        result = handle.result(WAIT)
    assert result.status == "completed" and result.output["model_calls"] == 2
    assert text_of(result.output["model_response"]["message"]) == "revised"
    first, second = model.requests
    assert shape(first.messages) == [("user", "write it")] and first.applied_steer_signal_ids == ()
    assert shape(second.messages) == [("user", "write it"), ("assistant", "draft"), ("user", "make it shorter")]
    assert second.applied_steer_signal_ids == ("s1",)


def test_i14_steer_during_a_tool_batch_waits_for_the_whole_batch_and_disables_direct_completion(
    local_store_url: str,
) -> None:
    """Scope ``steer_test.go`` TestSteerDuringToolBatchWaitsForWholeBatchSettlement.

    Two direct-result calls run concurrently and a steer arrives while both run. When
    one finishes nothing happens; when both have, the model is called (the steer disabled
    direct completion) with assistant, tool message in call order, then the steer.
    Without the steer the same round completes directly (the control run).
    Adaptation: none beyond the common ones.
    """
    def run(steer: bool) -> tuple[Any, GatedModel]:
        log = CallLog()
        tool = ProbeTool("fetch", log, concurrency=concurrent_any, direct_result=True)
        gates = [tool.hold("c0"), tool.hold("c1")]
        model = GatedModel([tool_round(call("c0", "fetch"), call("c1", "fetch")), final("with the steer")])
        program = interaction(model, [tool], max_concurrent_tool_calls=2)
        with open_runtime(local_store_url, program) as runtime:
            handle = runtime.start(program, chat_input("fetch both"))
            for gate in gates:
                assert gate.entered.wait(WAIT)
            if steer:
                assert runtime.deliver_signals(handle.root_process_id, [steer_signal("s1", user("also check c2"))])
            gates[1].release.set()
            wait_until(lambda: child_by_key(runtime.capture(handle.tree_id), "interaction.tool.1.1").terminal,
                       "the second call's child to finish")
            assert len(model.requests) == 1
            gates[0].release.set()
            return handle.result(WAIT), model

    steered, model = run(steer=True)
    assert steered.status == "completed" and steered.output["model_calls"] == 2
    assert "direct_tool_results" not in steered.output
    assert shape(model.requests[1].messages) == [("user", "fetch both"), ("assistant", ["c0", "c1"]),
                                                 ("tool", ["c0", "c1"]), ("user", "also check c2")]
    direct, control = run(steer=False)
    assert [r["id"] for r in direct.output["direct_tool_results"]] == ["c0", "c1"] and len(control.requests) == 1


def test_i15_steer_requires_one_or_more_user_messages(local_store_url: str) -> None:
    """Scope ``steer_test.go`` TestSteerRequiresUserMessages.

    ``steer_signal`` refuses no messages, non-user roles and invalid messages; a valid
    steer is an unaddressed ``{"steer": {"messages": [...]}}`` signal. At the Runtime,
    an envelope that is not a steer, or a steer with a non-user message, is refused
    before admission (the Program's signal schema); a steer that passes the schema but
    holds an invalid message fails the Interaction with contract interaction.signal.invalid.
    Adaptation: our Descriptor signal schema names the user role, so most invalid steers
    never reach a Step.
    """
    for messages in ((), ({"role": "assistant", "content": "x"},), ({"role": "system", "content": "x"},),
                     ({"role": "user"},), ({"role": "user", "content": [{"type": "image"}]},)):
        with pytest.raises(InvalidInput):
            steer_signal("s1", *messages)
    with pytest.raises(InvalidInput):
        steer_signal("bad id/1", user("x"))
    ok = steer_signal("s1", user("x"), user("y"))
    assert ok.wait_id is None and ok.payload == {"steer": {"messages": [user("x"), user("y")]}}

    model = GatedModel([final("a"), final("b")], hold=[1])
    program = interaction(model)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("hello"))
        assert model.gates[1].entered.wait(WAIT)
        for payload in ({"hello": 1}, {"steer": {"messages": [{"role": "assistant", "content": "x"}]}},
                        {"steer": {"messages": []}}):
            with pytest.raises(InvalidInput) as refused:
                runtime.deliver_signals(handle.root_process_id, [SignalRequest("raw", payload)])
            assert refused.value.code == "engine.signal.schema"
        bad_part = {"steer": {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}}
        assert runtime.deliver_signals(handle.root_process_id, [SignalRequest("raw-2", bad_part)])
        model.gates[1].release.set()
        result = handle.result(WAIT)
    assert result.status == "failed"
    assert failure_of(result)["kind"] == "contract" and failure_of(result)["code"] == "interaction.signal.invalid"
    assert len(model.requests) == 1


@pytest.mark.parametrize("reason", ["content_filter", "stop"])
def test_i16_steer_does_not_mask_tool_calls_the_model_did_not_finish(local_store_url: str, reason: str) -> None:
    """Scope ``steer_test.go`` TestSteerDoesNotMaskRejectedModelToolCalls.

    The model answers with tool calls but a finish reason other than tool_calls/length,
    while a steer sits in the same window: the Interaction fails with external
    interaction.model.tool_calls_not_completed and no tool runs.
    Adaptation: none beyond the common ones.
    """
    log = CallLog()
    model = GatedModel([tool_round(call("x", "probe"), reason=reason)], hold=[1])
    program = interaction(model, [ProbeTool("probe", log)])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        assert model.gates[1].entered.wait(WAIT)
        runtime.deliver_signals(handle.root_process_id, [steer_signal("s1", user("hurry"))])
        model.gates[1].release.set()
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "failed"
    assert failure_of(result) == {
        "kind": "external",
        "code": "interaction.model.tool_calls_not_completed",
        "message": f'model output ended with "{reason}"; tool calls were not executed',
    }
    assert log.count() == 0 and len(tree.processes) == 1


# ---------------------------------------------------------------------------
# 17-18. Definite failures


def test_i17_definite_tool_failure_caused_by_cancellation_stays_definite_across_restore(durable_store_url: str) -> None:
    """Scope ``definite_failure_test.go`` TestDefiniteToolFailureSurvivesCancellationCauseAndTreeRestore.

    A ``ToolFailure`` caused by a cancellation, one caused by a deadline, one wrapped
    once (``raise X from ToolFailure``) and one inside an exception group are definite
    model-visible error results (failed / rejected), never unknown; a group of ordinary
    errors is unknown. After a restart (a new owner recovers the tree) no tool runs again;
    the only unknown is that call, which the host settles; the model sees every result in
    call order.
    Adaptation: Go's error chains are Python's explicit ``__cause__`` chain; errors.Join
    is an ExceptionGroup, whose members ``errors.As`` walks in order.
    """
    log = CallLog()

    def cancelled(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise ToolFailure("failed", "error: stopped after writing 2 of 5 rows", cause=DispatchCancelled("stop"))

    def deadline(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise ToolFailure("rejected", "error: the quota window closed", cause=TimeoutError())

    def wrapped(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise RuntimeError("adapter layer") from ToolFailure("failed", "error: upstream said 409")

    def joined(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise ExceptionGroup("two things", [RuntimeError("a"), ValueError("b")])

    def grouped(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        inner = ExceptionGroup("inner", [ToolFailure("rejected", "error: the first refusal"), ToolFailure("failed", "x")])
        raise ExceptionGroup("batch", [KeyError("k"), inner])

    tools = [ProbeTool("cancelled_op", log, cancelled), ProbeTool("deadline_op", log, deadline),
             ProbeTool("wrapped_op", log, wrapped), ProbeTool("grouped_op", log, grouped),
             ProbeTool("joined_op", log, joined)]
    model = ScriptedModel([tool_round(call("c0", "cancelled_op"), call("c1", "deadline_op"), call("c2", "wrapped_op"),
                                      call("c3", "grouped_op"), call("c4", "joined_op")), final("noted")])
    program = interaction(model, tools)
    with open_runtime(durable_store_url, program) as first:
        handle = first.start(program, chat_input("do four things"))
        tree = first.wait_idle(handle.tree_id)
        r = only_round(tree)
        assert [(e.tool_call_index, e.disposition) for e in r.entries] == [
            (0, "failed"), (1, "rejected"), (2, "failed"), (3, "rejected")]
        assert [u["tool_call_ref"] for u in unknown_of(first, tree)] == [f"{handle.root_process_id}/1/4"]
    with open_runtime(durable_store_url, program) as runtime:
        recover(runtime, handle.tree_id)
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["tool_call_ref"] == f"{handle.root_process_id}/1/4"
        assert [log.count(n) for n in ("cancelled_op", "deadline_op", "wrapped_op", "joined_op", "grouped_op")] == [
            1, 1, 1, 1, 1]
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        runtime.resolve_unknown_effect(
            unknown["effect_id"], settle_tool_result(tool_program(program), request, "error: a and b", "failed")
        )
        result = runtime.result(handle.tree_id, WAIT)
    assert result.status == "completed"
    assert [log.count(n) for n in ("cancelled_op", "deadline_op", "wrapped_op", "joined_op", "grouped_op")] == [
        1, 1, 1, 1, 1]
    results = tool_message_of(model.requests[1])["tool_results"]
    assert [(r["id"], text_of(r["output"]), r.get("is_error")) for r in results] == [
        ("c0", "error: stopped after writing 2 of 5 rows", True),
        ("c1", "error: the quota window closed", True),
        ("c2", "error: upstream said 409", True),
        ("c3", "error: the first refusal", True),
        ("c4", "error: a and b", True),
    ]


def test_i18_cancelling_the_interaction_keeps_a_definite_tool_settlement_visible(local_store_url: str) -> None:
    """Scope ``definite_failure_test.go`` TestProcessCancellationRetainsDefiniteToolSettlement.

    The host cancels the Interaction while its tool runs; the tool notices and returns a
    definite ToolFailure. The settlement is recorded as definite (no unknown effect,
    nothing unresolved) although no Process consumes it, and SettledResults still shows
    it for the cancelled round.
    Adaptation: our cancelled parent ends at once and its Tool child ends after its
    in-flight effect settles; the definite settlement stays in the child's batch.
    """
    log = CallLog()

    def stop_cleanly(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        assert invocation.context is not None and invocation.context.cancelled.is_set()
        raise ToolFailure("failed", "error: rolled back after cancellation", cause=DispatchCancelled("cancelled"))

    tool = ProbeTool("migrate", log, stop_cleanly)
    gate = tool.hold("m1", honour_cancel=False)
    program = interaction(ScriptedModel([tool_round(call("m1", "migrate")), final("x")]), [tool])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("migrate"))
        assert gate.entered.wait(WAIT)
        runtime.cancel(handle.root_process_id, "the user gave up")
        child = child_by_key(runtime.capture(handle.tree_id), "interaction.tool.1.0")
        wait_until(lambda: runtime.capture(handle.tree_id).processes[child.process_id].terminal_intent is not None,
                   "the cancellation to reach the tool child")
        gate.release.set()
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "canceled"
    child = tree.processes[child.process_id]
    assert child.status == "canceled" and child.termination.unresolved_effect_ids == ()
    assert unknown_effects(tree) == [] and tree.classification() == "terminal"
    # The definite settlement was delivered but never consumed: it waits in the child's mailbox.
    [settlement] = [r for r in child.pending() if r.status is not None]
    assert settlement.status.value == "succeeded" and settlement.payload["tool_result"]["completion"]["disposition"] == "failed"
    entry = only_round(tree).entries
    assert [(e.tool_call_index, e.disposition, text_of(e.output)) for e in entry] == [
        (0, "failed", "error: rolled back after cancellation")
    ]
    assert log.count() == 1


# ---------------------------------------------------------------------------
# 19. Concurrency


def _sleepy(delays: dict[str, float], together: tuple[str, ...] = ()) -> Any:
    """Each call sleeps a little; the calls named in ``together`` must all be running at once."""
    barrier = threading.Barrier(len(together)) if together else None

    def behave(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if barrier is not None and invocation.call.id in together:
            barrier.wait(WAIT)  # a BrokenBarrierError means they never ran concurrently
        time.sleep(delays.get(invocation.call.id, 0.03))
        return ToolOutput.text(f"done:{invocation.call.id}")

    return behave


def _run_round(url: str, tools: list[Any], calls: list[dict[str, Any]], limit: int) -> tuple[Any, ScriptedModel]:
    model = ScriptedModel([tool_round(*calls), final("ok")])
    program = interaction(model, tools, max_concurrent_tool_calls=limit)
    with open_runtime(url, program) as runtime:
        result = runtime.start(program, chat_input("go")).result(WAIT)
    assert result.status == "completed", result
    return result, model


def test_i19_concurrency_limit_is_respected_and_results_keep_model_order(local_store_url: str) -> None:
    """Scope ``concurrency_test.go`` (limit respected, results in model order).

    Four concurrent calls with a limit of 2: never more than two run at once, the window
    refills as calls finish, and the model receives results in call order although the
    first call finishes last.
    """
    log = CallLog()
    tool = ProbeTool("work", log, _sleepy({"c0": 0.25}, together=("c0", "c1")), concurrency=concurrent_any)
    _, model = _run_round(local_store_url, [tool], [call(f"c{i}", "work") for i in range(4)], 2)
    assert log.max_active() == 2
    assert set(log.started()[:2]) == {"c0", "c1"} and log.count() == 4
    assert [r["id"] for r in tool_message_of(model.requests[1])["tool_results"]] == ["c0", "c1", "c2", "c3"]


def test_i19_calls_with_the_same_concurrency_key_never_overlap(local_store_url: str) -> None:
    """Scope ``concurrency_test.go`` (same key never overlaps)."""
    log = CallLog()
    tool = ProbeTool("db", log, _sleepy({}), concurrency=keyed(lambda args: args["table"]))
    calls = [call("k1", "db", {"table": "users"}), call("k2", "db", {"table": "users"}), call("k3", "db", {"table": "orders"})]
    _run_round(local_store_url, [tool], calls, 3)
    assert "k2" not in log.overlapped("k1") and "k1" not in log.overlapped("k2")
    assert log.count() == 3


def test_i19_limit_zero_runs_one_call_at_a_time(local_store_url: str) -> None:
    """Scope ``concurrency_test.go`` (limit 0 serializes: zero means one)."""
    log = CallLog()
    tool = ProbeTool("work", log, _sleepy({}), concurrency=concurrent_any)
    _run_round(local_store_url, [tool], [call(f"c{i}", "work") for i in range(3)], 0)
    assert log.max_active() == 1 and log.started() == ["c0", "c1", "c2"]


def test_i19_a_tool_without_a_concurrency_policy_runs_alone(local_store_url: str) -> None:
    """Scope ``concurrency_test.go`` (an undeclared tool is an exclusive barrier)."""
    log = CallLog()
    shared = ProbeTool("shared", log, _sleepy({}, together=("a", "b")), concurrency=concurrent_any)
    exclusive = ProbeTool("exclusive", log, _sleepy({}))
    calls = [call("a", "shared"), call("b", "shared"), call("x", "exclusive"), call("c", "shared"), call("d", "shared")]
    _run_round(local_store_url, [shared, exclusive], calls, 4)
    assert log.overlapped("x") == []
    assert log.started() in (["a", "b", "x", "c", "d"], ["b", "a", "x", "c", "d"], ["a", "b", "x", "d", "c"],
                             ["b", "a", "x", "d", "c"])
    assert log.max_active(["a", "b"]) == 2


def test_i19_an_invalid_concurrency_declaration_or_limit_is_refused_at_construction() -> None:
    """Scope ``concurrency_test.go`` (panicking policy rejected at NewToolSet; negative limit rejected).

    Adaptation: Go's panicking ConcurrencyPolicy() is a ``concurrency`` attribute whose
    reading raises; both refusals are InvalidInput at ``compile_interaction``.
    """

    class Broken(ProbeTool):
        @property
        def concurrency(self) -> Any:  # type: ignore[override]
            raise RuntimeError("policy backend unavailable")

    with pytest.raises(InvalidInput) as broken:
        interaction(ScriptedModel([]), [Broken("broken", CallLog())])
    assert broken.value.code == "interaction.toolset.invalid"
    with pytest.raises(InvalidInput):
        interaction(ScriptedModel([]), [ProbeTool("t", CallLog())], max_concurrent_tool_calls=-1)
    with pytest.raises(InvalidInput):
        interaction(ScriptedModel([]), max_concurrent_tool_calls=2)  # a limit without a ToolSet


def test_i19_an_input_wait_keeps_its_completed_sibling_which_runs_once(local_store_url: str) -> None:
    """Scope ``concurrency_test.go`` (input wait keeps completed sibling; sibling runs once)."""
    log = CallLog()
    ask = asking(log)
    ask.concurrency = concurrent_any
    quick = ProbeTool("quick", log, concurrency=concurrent_any)
    model = ScriptedModel([tool_round(call("a", "ask"), call("q", "quick")), final("ok")])
    program = interaction(model, [ask, quick], max_concurrent_tool_calls=2)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        tree = runtime.wait_idle(handle.tree_id)
        assert [(e.tool_call_index, e.disposition) for e in only_round(tree).entries] == [(1, "succeeded")]
        [pending] = pending_tool_inputs(tree)
        runtime.deliver_signals(pending.process_id, [pending.response_signal("ok-1", {"ok": True})])
        result = handle.result(WAIT)
    assert result.status == "completed"
    assert log.count("quick") == 1 and log.count("ask") == 2
    assert [r["id"] for r in tool_message_of(model.requests[1])["tool_results"]] == ["a", "q"]


# ---------------------------------------------------------------------------
# 20. An answer admitted before the Tool child consumes it (pause, restore)


@pytest.mark.parametrize("restore", [False, True])
def test_i20_answer_admitted_while_the_tool_child_is_paused_survives_restore_with_exact_usage(
    local_store_url: str, restore: bool
) -> None:
    """Scope ``tool_input_order_test.go`` TestToolInputAnswerQueuedBeforeWaitAdoptionSurvivesPauseAndRestore.

    The ToolSet program runs as a root (so its invocation has no reference). The tool
    asks for input; the host pauses the Process, reads the pending input (listed while
    paused), and answers: the answer is admitted and queued, the Process stays paused.
    Optionally a new Runtime takes over. Resume lets the Process consume the answer and
    complete, with usage exactly 5 steps, 3 effects, 4 signals (call, input request,
    adopt the wait, resume, complete; two tool calls and the wait; two settlements, the
    wait opening and the answer).
    Adaptation: our owner opens and adopts a wait in one append, so no host can address
    a wait that is open but not yet adopted; through the Runtime the nearest case is an
    answer admitted while the Process cannot consume it (paused), consumed only after
    Resume. The exact pre-adoption interleaving is the next test (Kernel driven by hand).
    """
    log = CallLog()
    ask = asking(log)
    tools = tool_program(interaction(ScriptedModel([]), [ask]))
    store = EventStore(local_store_url)
    with open_runtime(store, tools) as runtime:
        handle = runtime.start(tools, {"call": call("c1", "ask", {"n": 1})})
        tree = runtime.wait_idle(handle.tree_id)
        assert tree.root.status == "waiting"
        assert runtime.pause(handle.root_process_id, "operator review")
        [pending] = pending_tool_inputs(runtime.capture(handle.tree_id))
        assert pending.process_id == handle.root_process_id and pending.reference is None
        assert runtime.deliver_signals(pending.process_id, [pending.response_signal("answer-1", {"ok": True})])
        tree = runtime.wait_idle(handle.tree_id)
        assert tree.root.status == "paused" and tree.root.pending_count == 1 and log.count() == 1
        if not restore:
            assert runtime.resume(handle.root_process_id)
            result = runtime.result(handle.tree_id, WAIT)
    if restore:
        with open_runtime(store, tools) as second:
            assert second.capture(handle.tree_id).root.status == "paused"
            assert second.resume(handle.root_process_id)  # this Runtime takes ownership to admit it
            result = second.result(handle.tree_id, WAIT)
    store.close()
    assert result.status == "completed"
    assert result.output == {"disposition": "succeeded", "output": {
        "content": [{"type": "text", "text": "approved=True"}], "details": {"state": {"asked": "c1"}}}}
    assert result.usage == {"steps": 5, "effects": 3, "signals": 4}
    assert [i.reference for i in log.invocations] == [None, None]
    assert log.invocations[0].effect_id != log.invocations[1].effect_id


def test_i20_answer_admitted_before_the_tool_child_adopts_its_wait_is_consumed_after_pause(local_store_url: str) -> None:
    """Scope ``tool_input_order_test.go`` TestToolInputAnswerQueuedBeforeWaitAdoptionSurvivesPauseAndRestore.

    The exact interleaving: the Tool child (a root, so no reference) has opened its input
    wait but not yet taken the Step that adopts it when the answer is admitted; then the
    host pauses it. The history is stored, a Runtime recovers it (WriterActivated), and
    Resume lets the child adopt the already-answered wait (it stays runnable), consume
    the answer and complete with usage exactly 5 steps, 3 effects, 4 signals.
    Adaptation: our owner never stops between opening and adopting a wait, so this
    interleaving is produced by driving the real Kernel by hand (the rules the owner
    applies; ``advance(max_events=2)`` stops right after the wait opened - a wait settles
    by itself when it reaches the frontier, so its declaration opens it) with the real
    ToolDispatcher; the resulting events are appended to a real store, folded by a
    Runtime and driven to the end by it.
    """
    log = CallLog()
    tools = tool_program(interaction(ScriptedModel([]), [asking(log)]))
    catalog = Catalog([tools])
    ids = RandomIds()
    started = start_tree(tools, {"call": call("c1", "ask")}, start_id=StartID("start:early-answer"),
                         root_id=ids.root_process_id(), incarnation_id=ids.incarnation_id())
    tree = TreeState(catalog.resolve)
    tree.apply(started)
    kernel = Kernel(tree, catalog.resolve, ids)
    events: list[Any] = [started]

    def dispatch_once() -> None:
        progress = kernel.advance()
        events.extend(progress.events)
        [d] = progress.dispatches
        request = effect_request(tree, d.process_id, d.effect_id, tools, d.attempt_id)
        settlement = tools.dispatcher.dispatch(request, DispatchContext())
        events.extend(kernel.settle_dispatch(d.process_id, d.effect_id, d.attempt_id, settlement.status,
                                             settlement.payload, None))

    dispatch_once()  # the tool asks for input
    opened = kernel.advance(max_events=2)  # input-request Step, wait Effect (opened at once) - not adopted
    events.extend(opened.events)
    root = tree.root
    [wait_id] = list(root.waits)
    assert root.status == "running" and root.current_wait is None and not root.waits[wait_id].closed
    events.extend(kernel.admit_signals(root.process_id, [SignalRequest("answer-1", {"input_response": {"ok": True}},
                                                                       wait_id)]))
    events.extend(kernel.request_control(root.process_id, "pause", "operator review"))
    assert kernel.advance().events == [] and root.status == "paused"

    store = EventStore(local_store_url)
    store.append(started.tree_id, 0, events, previous_digest=None, timestamp=utc_now(),
                 head=index_head(tree, started.tree_id, events, utc_now()))
    with open_runtime(store, catalog=catalog) as runtime:
        stored = runtime.capture(started.tree_id)
        assert stored.root.status == "paused" and stored.root.pending_count >= 1
        recover(runtime, started.tree_id)
        assert runtime.resume(root.process_id)
        result = runtime.result(started.tree_id, WAIT)
    store.close()
    assert result.status == "completed" and result.usage == {"steps": 5, "effects": 3, "signals": 4}
    assert text_of(result.output["output"]) == "approved=True"
    assert [i.reference for i in log.invocations] == [None, None] and log.count() == 2

# ---------------------------------------------------------------------------
# 21. References across attempts, rounds, observers and parents


class _Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, str]] = []

    def on_tool_started(self, invocation: ToolInvocation) -> None:
        self.seen.append(("started", invocation.call.id, str(invocation.reference), invocation.effect_id))

    def on_tool_settled(self, invocation: ToolInvocation, settlement: Any) -> None:
        self.seen.append(("settled", invocation.call.id, str(invocation.reference), invocation.effect_id))
        raise RuntimeError("an observer bug must not change anything")


def test_i21_a_tool_call_reference_is_stable_across_attempts_and_distinct_across_rounds_and_parents(
    local_store_url: str,
) -> None:
    """Scope ``reference_lifecycle_test.go`` TestLogicalReferenceAcrossAttemptsRoundsObserversAndParents.

    The provider reuses the call id "call-1" in two rounds. In round 1 the tool asks for
    input, so the call has two attempts: distinct effects and attempt ids, one reference
    (root/1/0), the same one the pending input and the observer report.
    Round 2's call is root/2/0. A second Interaction (another parent) running the same
    script gets references with its own process id. Observer exceptions are isolated
    and counted; they change no outcome.
    Adaptation: "parents" are two root Interactions in one store.
    """
    log = CallLog()
    observer = _Observer()
    model = ScriptedModel([tool_round(call("call-1", "ask")), tool_round(call("call-1", "probe")), final("done")])
    program = interaction(model, [asking(log), ProbeTool("probe", log)], tool_observer=observer)
    roots = []
    with open_runtime(local_store_url, program) as runtime:
        for n in range(2):
            handle = runtime.start(program, chat_input(f"task {n}"))
            tree = runtime.wait_idle(handle.tree_id)
            [pending] = pending_tool_inputs(tree)
            assert settled_results(tree) == []  # the round's only call has no definite result yet
            assert pending.reference == ToolCallRef(handle.root_process_id, 1, 0)
            runtime.deliver_signals(pending.process_id, [pending.response_signal(f"answer-{n}", {"ok": True})])
            assert handle.result(WAIT).status == "completed"
            roots.append(handle.root_process_id)
    dispatcher = tool_program(program).dispatcher
    refs = [(i.call.id, str(i.reference)) for i in log.invocations]
    assert refs == [
        ("call-1", f"{roots[0]}/1/0"), ("call-1", f"{roots[0]}/1/0"), ("call-1", f"{roots[0]}/2/0"),
        ("call-1", f"{roots[1]}/1/0"), ("call-1", f"{roots[1]}/1/0"), ("call-1", f"{roots[1]}/2/0"),
    ]
    ask_attempts = log.invocations[:2]
    assert ask_attempts[0].effect_id != ask_attempts[1].effect_id
    assert ask_attempts[0].attempt_id != ask_attempts[1].attempt_id and None not in [a.attempt_id for a in ask_attempts]
    assert ask_attempts[0].continuation is None and ask_attempts[1].continuation is not None
    assert [(kind, ref, eid) for kind, _, ref, eid in observer.seen if kind == "started"] == [
        ("started", str(i.reference), i.effect_id) for i in log.invocations
    ]
    assert [ref for kind, _, ref, _ in observer.seen if kind == "settled"] == [str(i.reference) for i in log.invocations]
    assert dispatcher.observation_failures.counts == {"tool_settled": 6}


# ---------------------------------------------------------------------------
# 22-23. Child admission and child failures


def _reloaded_root(url_or_store: Any, program: Program, tree_id: Any) -> Any:
    with open_runtime(url_or_store, program) as fresh:
        return fresh.capture(tree_id)


def test_i22_tool_child_failures_fail_the_interaction_and_leave_it_restorable(local_store_url: str) -> None:
    """Scope ``child_failure_test.go`` TestToolChildFailuresRetainRestorableParentState.

    A refused Tool child start fails the Interaction with the refusal's Failure; a Tool
    child that exhausts its step grant fails it with engine.limit.steps, unchanged. In
    both cases the stored history folds again (a new Runtime) into the same Interaction
    state, with the round still open at the failed call.
    Adaptation: Scope's admission refusal code engine.child.admission.rejected is, in our
    kernel, the code of the limit that refused (here engine.child.tree_limit).
    """
    log = CallLog()
    model = ScriptedModel([tool_round(call("c0", "probe")), final("x")])
    refused = interaction(model, [ProbeTool("probe", log)], name="test.refused")
    starved = interaction(model, [ProbeTool("probe", log)], name="test.starved", tool_budget=Budget.of(steps=1))
    store = EventStore(local_store_url)
    with open_runtime(store, refused, starved) as runtime:
        one = runtime.start(refused, chat_input("go"), limits=TreeLimits(max_tree_processes=1))
        first = one.result(WAIT)
        two = runtime.start(starved, chat_input("go"))
        second = two.result(WAIT)
        live = [runtime.capture(h.tree_id) for h in (one, two)]
    assert first.status == "failed" and failure_of(first)["code"] == "engine.child.tree_limit"
    assert failure_of(first)["kind"] == "execution"
    assert second.status == "failed" and failure_of(second)["code"] == "engine.limit.steps"
    starved_child = child_by_key(live[1], "interaction.tool.1.0")
    assert starved_child.termination.failure.to_json() == failure_of(second)
    for handle, tree in zip((one, two), live, strict=True):
        again = _reloaded_root(store, refused if handle is one else starved, handle.tree_id)
        state = again.root.state
        assert isinstance(state, InteractionState) and state.round is not None and state.round.cursor == 0
        assert state.to_json() == tree.root.state.to_json()
    store.close()
    assert log.count() == 1  # the refused child never ran; the starved one ran its call, then hit the limit


def _worker(name: str, responses: list[dict[str, Any]], tools: list[Any] = ()) -> tuple[Program, ScriptedModel]:  # type: ignore[assignment]
    model = ScriptedModel(responses)
    return interaction(model, list(tools), name=name), model


def _task_input(arguments: Any) -> Any:
    return {"messages": [user(f"task: {arguments['task']}")]}


TASK_SCHEMA = {"type": "object", "required": ["task"], "properties": {"task": {"type": "string"}},
               "additionalProperties": False}


def test_i23_a_refused_tool_start_fails_the_interaction_but_a_refused_delegate_start_is_model_visible(
    local_store_url: str,
) -> None:
    """Scope ``child_failure_test.go`` TestChildAdmissionFailurePolicyDistinguishesToolsAndDelegates.

    Under a finite root budget, a Tool child whose grant does not fit is refused and the
    Interaction fails with that Failure (the ToolSet is required infrastructure); a
    Delegate whose grant does not fit gets a model-visible rejected result and the run
    completes. No child Process exists for either.
    Adaptation: the refusal is our engine.child.budget_exhausted (Scope: admission rejected).
    """
    budget = Budget.of(steps=500, effects=500, signals=500)
    too_big = Budget.of(steps=10_000, effects=10_000, signals=10_000)
    log = CallLog()
    tool_side = interaction(ScriptedModel([tool_round(call("t", "probe")), final("x")]), [ProbeTool("probe", log)],
                            name="test.tool-side", tool_budget=too_big)
    helper, helper_model = _worker("test.helper", [final("helped")])
    delegate_model = ScriptedModel([tool_round(call("d", "helper", {"task": "t"})), final("handled the refusal")])
    delegate_side = interaction(
        delegate_model, name="test.delegate-side",
        delegates=[Delegate("helper", "Helps.", helper, TASK_SCHEMA, budget=too_big, build_input=_task_input)],
    )
    with open_runtime(local_store_url, tool_side, delegate_side) as runtime:
        tool_run = runtime.start(tool_side, chat_input("go"), budget=budget)
        tool_result = tool_run.result(WAIT)
        delegate_run = runtime.start(delegate_side, chat_input("go"), budget=budget)
        delegate_result = delegate_run.result(WAIT)
        trees = [runtime.capture(h.tree_id) for h in (tool_run, delegate_run)]
    assert tool_result.status == "failed" and failure_of(tool_result)["code"] == "engine.child.budget_exhausted"
    assert delegate_result.status == "completed" and delegate_result.output["model_calls"] == 2
    [rejected] = tool_message_of(delegate_model.requests[1])["tool_results"]
    assert rejected["is_error"] is True
    assert text_of(rejected["output"]).startswith("error: delegated worker child start failed: engine.child.budget_exhausted: ")
    assert [len(t.processes) for t in trees] == [1, 1]
    assert log.count() == 0 and helper_model.requests == []


# ---------------------------------------------------------------------------
# 24. Delegates


def test_i24_mixed_tool_and_delegate_calls_keep_call_order_and_apply_delegate_grants(local_store_url: str) -> None:
    """Scope ``delegate_test.go`` (mixed order, child budget and capabilities applied).

    Round [tool, delegate, tool, delegate]: the model sees results in call order; each
    Delegate child runs its exact Program with the Delegate's budget and capabilities
    (a subset of the root's), keyed by delegate_child_key; a successful Delegate result
    carries the child's output as details and becomes an Artifact for the validator.
    """
    log = CallLog()
    researcher, researcher_model = _worker("test.researcher", [final("found it")])
    grant = Budget.of(steps=60, effects=60, signals=60)
    artifacts: list[Any] = []

    def validator(candidate: CompletionCandidate) -> CompletionDecision:
        artifacts.extend(candidate.artifacts)
        return CompletionDecision(True)

    model = ScriptedModel([
        tool_round(call("t0", "probe"), call("d1", "research", {"task": "a"}), call("t2", "probe"),
                   call("d3", "research", {"task": "b"})),
        final("summary"),
    ])
    program = interaction(
        model, [ProbeTool("probe", log)], tool_budget=Budget.of(steps=10, effects=10, signals=10),
        delegates=[Delegate("research", "Researches a task.", researcher, TASK_SCHEMA, budget=grant,
                            capabilities=frozenset({"net"}), build_input=_task_input)],
        completion_validator=validator,
    )
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"), budget=Budget.of(steps=1000, effects=1000, signals=1000),
                               capabilities=["net", "fs"])
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
    assert result.status == "completed"
    results = tool_message_of(model.requests[1])["tool_results"]
    assert [r["id"] for r in results] == ["t0", "d1", "t2", "d3"]
    assert results[1]["output"]["details"]["model_response"]["message"]["content"][0]["text"] == "found it"
    for call_id, task in (("d1", "a"), ("d3", "b")):
        child = child_by_key(tree, delegate_child_key(1, call_id, "research"))
        assert child.program == researcher.ref and child.budget == grant and child.capabilities == ("net",)
        assert child.input == {"messages": [user(f"task: {task}")]}
    assert child_by_key(tree, "interaction.tool.1.0").budget == Budget.of(steps=10, effects=10, signals=10)
    assert [(a["tool_call_id"], a["delegate_name"], a["model_call_sequence"]) for a in artifacts] == [
        ("d1", "research", 1), ("d3", "research", 1)]
    attributions, found = delegate_attributions(tree, handle.root_process_id)
    assert found and [(str(a.reference), a.child_key) for a in attributions] == [
        (f"{handle.root_process_id}/1/1", delegate_child_key(1, "d1", "research")),
        (f"{handle.root_process_id}/1/3", delegate_child_key(1, "d3", "research")),
    ]
    assert len(researcher_model.requests) == 2 and log.count() == 2


def test_i24_invalid_delegate_bindings_are_refused_at_construction() -> None:
    """Scope ``delegate_test.go`` (non-object input, bad names and descriptions, collisions, byte limits)."""
    worker_program, _ = _worker("test.w", [])
    model = ScriptedModel([])

    def build(*delegates: Delegate, tools: list[Any] = ()) -> Program:  # type: ignore[assignment]
        return interaction(model, list(tools), delegates=list(delegates))

    for bad in (
        Delegate("w", "Works.", worker_program, {"type": "string"}),
        Delegate("bad name", "Works.", worker_program, TASK_SCHEMA),
        Delegate("", "Works.", worker_program, TASK_SCHEMA),
        Delegate("w", " padded", worker_program, TASK_SCHEMA),
        Delegate("w", "x" * 4097, worker_program, TASK_SCHEMA),
        Delegate("w", "\u00e9" * 2049, worker_program, TASK_SCHEMA),  # 4098 bytes of UTF-8
    ):
        with pytest.raises(InvalidInput):
            build(bad)
    build(Delegate("w", "x" * 4096, worker_program, TASK_SCHEMA))
    with pytest.raises(InvalidInput):
        build(Delegate("w", "One.", worker_program, TASK_SCHEMA), Delegate("w", "Two.", worker_program, TASK_SCHEMA))
    with pytest.raises(InvalidInput):
        build(Delegate("probe", "Collides.", worker_program, TASK_SCHEMA), tools=[ProbeTool("probe", CallLog())])


def test_i24_delegate_argument_failures_reach_the_model_without_creating_processes(local_store_url: str) -> None:
    """Scope ``delegate_test.go`` (argument failures returned to the model without a Process)."""
    helper, helper_model = _worker("test.helper", [final("never")])
    model = ScriptedModel([
        tool_round({"id": "d1", "name": "helper", "arguments": "{not json"}, call("d2", "helper", {"task": 5}),
                   call("u3", "nowhere")),
        final("understood"),
    ])
    program = interaction(model, delegates=[Delegate("helper", "Helps.", helper, TASK_SCHEMA, build_input=_task_input)])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
    assert result.status == "completed" and len(tree.processes) == 1 and helper_model.requests == []
    texts = [(r["id"], text_of(r["output"]), r.get("is_error")) for r in tool_message_of(model.requests[1])["tool_results"]]
    assert texts[0][0] == "d1" and texts[0][1].startswith("error: arguments are not valid JSON") and texts[0][2]
    assert texts[1][0] == "d2" and texts[1][1].startswith("error: arguments violate the delegated worker input contract")
    assert texts[2] == ("u3", 'error: tool "nowhere" is not available', True)


def test_i24_a_waiting_delegate_tree_restores_without_restarting_the_delegate(local_store_url: str) -> None:
    """Scope ``delegate_test.go`` (waiting Delegate tree restores; ActiveDelegateChildren reports it).

    The Delegate is an Interaction whose tool waits for input. A new Runtime over the
    same store reports the delegation (reference, key, child process), the pending input
    inside the Delegate (referenced by the Delegate's own call), and after the answer the
    same Delegate Process completes: it was never restarted and its first model call
    was never repeated.
    Adaptation: ``delegate_attributions`` is the seed's DelegateAttributions (the spec's
    ActiveDelegateChildren); it keeps reporting finished Delegates too.
    """
    log = CallLog()
    approver, approver_model = _worker("test.approver", [tool_round(call("w1", "ask")), final("approved")],
                                       [asking(log)])
    model = ScriptedModel([tool_round(call("d1", "approve", {"task": "ship"})), final("shipped")])
    program = interaction(model, delegates=[Delegate("approve", "Gets an approval.", approver, TASK_SCHEMA,
                                                     build_input=_task_input)])
    store = EventStore(local_store_url)
    with open_runtime(store, program) as first:
        handle = first.start(program, chat_input("ship it"))
        first.wait_idle(handle.tree_id)
    with open_runtime(store, program) as runtime:
        tree = runtime.capture(handle.tree_id)
        [attribution], found = delegate_attributions(tree, handle.root_process_id)
        assert found and attribution.reference == ToolCallRef(handle.root_process_id, 1, 0)
        assert attribution.child_key == delegate_child_key(1, "d1", "approve") and attribution.call.id == "d1"
        delegate = tree.processes[attribution.child_process_id]
        assert delegate.status == "waiting" and delegate.program == approver.ref
        [pending] = pending_tool_inputs(tree)
        assert pending.reference == ToolCallRef(delegate.process_id, 1, 0)
        runtime.deliver_signals(pending.process_id, [pending.response_signal("a1", {"ok": True})])
        result = runtime.result(handle.tree_id, WAIT)
        done = runtime.capture(handle.tree_id)
    store.close()
    assert result.status == "completed"
    assert [p.process_id for p in done.processes.values() if p.program == approver.ref] == [delegate.process_id]
    assert [r.model_call_sequence for r in approver_model.requests] == [1, 2] and log.count("ask") == 2
    assert delegate_attributions(done, handle.root_process_id)[0][0].child_process_id == delegate.process_id


# ---------------------------------------------------------------------------
# 25. Direct results and completion


def test_i25_a_failing_direct_tool_forces_a_model_continuation(local_store_url: str) -> None:
    """Scope ``direct_result_test.go`` (a failing direct tool forces a model continuation)."""
    log = CallLog()

    def flaky(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if arguments.get("fail"):
            raise ToolFailure("failed", "error: not found", cause=KeyError("x"))
        return ToolOutput.text("found")

    tool = ProbeTool("find", log, flaky, direct_result=True)
    failing_model = ScriptedModel([tool_round(call("f", "find", {"fail": True})), final("could not find it")])
    passing_model = ScriptedModel([tool_round(call("f", "find", {"fail": False})), final("unused")])
    failing_program = interaction(failing_model, [tool], name="test.failing")
    passing_program = interaction(passing_model, [tool], name="test.passing")
    with open_runtime(local_store_url, failing_program, passing_program) as runtime:
        failed_direct = runtime.start(failing_program, chat_input("find")).result(WAIT)
        direct = runtime.start(passing_program, chat_input("find")).result(WAIT)
    assert failed_direct.status == "completed" and failed_direct.output["model_calls"] == 2
    assert text_of(failed_direct.output["model_response"]["message"]) == "could not find it"
    assert direct.output == {"direct_tool_results": [{"id": "f", "name": "find",
                                                      "output": {"content": [{"type": "text", "text": "found"}]}}],
                             "model_calls": 1}
    assert len(passing_model.requests) == 1


@pytest.mark.parametrize(
    ("case", "kind", "code"),
    [
        ("validator_error", "execution", "interaction.completion.validator_failed"),
        ("invalid_decision", "contract", "interaction.completion.decision_invalid"),
        ("retry_at_limit", "execution", "interaction.limit.model_calls"),
    ],
)
def test_i25_completion_is_validated_and_each_refusal_has_its_code(local_store_url: str, case: str, kind: str, code: str) -> None:
    """Scope ``direct_result_test.go`` (Output validation; validator error / invalid decision / retry at limit).

    A validator that raises, one that returns an invalid decision, and a rejection when no
    model call is left each end the run with their own code. (A final answer that ended
    with ``length`` is not refused: Scope completes it, test_scope_differential.py.)
    """
    responses = [final("candidate")]

    def validator(candidate: CompletionCandidate) -> CompletionDecision:
        if case == "validator_error":
            raise ValueError("the checker crashed")
        if case == "invalid_decision":
            return CompletionDecision(True, "accepted, but with feedback")
        return CompletionDecision(False, "cite your sources")

    model = ScriptedModel(responses)
    program = interaction(model, completion_validator=validator, max_model_calls=1)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("answer")).result(WAIT)
    assert result.status == "failed"
    assert (failure_of(result)["kind"], failure_of(result)["code"]) == (kind, code)
    assert len(model.requests) == 1


def test_i25_a_rejected_completion_feeds_back_and_retries_within_the_quota(local_store_url: str) -> None:
    """Scope ``direct_result_test.go`` (validator retry): the feedback is a user message for the next call."""
    seen: list[CompletionCandidate] = []

    def validator(candidate: CompletionCandidate) -> CompletionDecision:
        seen.append(candidate)
        text = text_of(candidate.output["model_response"]["message"])
        return CompletionDecision(True) if "[1]" in text else CompletionDecision(False, "cite your sources")

    model = ScriptedModel([final("the answer"), final("the answer [1]")])
    program = interaction(model, completion_validator=validator, max_model_calls=2)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("answer")).result(WAIT)
    assert result.status == "completed" and result.output["model_calls"] == 2
    assert shape(seen[0].working_context) == [("user", "answer")]  # the candidate is not in its own context
    assert shape(model.requests[1].messages) == [("user", "answer"), ("assistant", "the answer"),
                                                 ("user", "cite your sources")]
    assert model.requests[1].applied_steer_signal_ids == ()


# ---------------------------------------------------------------------------
# 26. Child batch outcomes


def test_i26_a_delegate_subtree_left_with_unknown_effects_fails_the_interaction_naming_them(local_store_url: str) -> None:
    """Scope ``child_batch_test.go`` (unresolved Delegate subtree → interaction.delegate.unresolved_effects).

    The Delegate's model call ends unknown; the host cancels the Delegate, which ends
    with that effect unresolved; the parent fails (external) naming the effect id and
    makes no further model call.
    """
    helper, _ = _worker("test.helper", [{"error": "provider timeout"}])
    model = ScriptedModel([tool_round(call("d1", "helper", {"task": "t"})), final("never")])
    program = interaction(model, delegates=[Delegate("helper", "Helps.", helper, TASK_SCHEMA, build_input=_task_input)])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        delegate = child_by_key(tree, delegate_child_key(1, "d1", "helper"))
        assert unknown["process_id"] == delegate.process_id
        runtime.cancel(delegate.process_id, "giving up on the helper")
        result = handle.result(WAIT)
    assert result.status == "failed"
    assert failure_of(result) == {
        "kind": "external",
        "code": "interaction.delegate.unresolved_effects",
        "message": f"Delegate subtree {delegate.process_id} ended with unresolved Effects [{unknown['effect_id']}]",
    }
    assert len(model.requests) == 1


@pytest.mark.parametrize(("control", "status", "cause", "reason"), [
    ("cancel", "canceled", "host_cancellation", "operator stopped it"),
    ("deadline", "timed_out", "host_deadline", "the tool took too long"),
])
def test_i26_a_cancelled_or_timed_out_tool_child_fails_the_interaction_with_process_failed(
    local_store_url: str, control: str, status: str, cause: str, reason: str
) -> None:
    """Scope ``child_batch_test.go`` (canceled/timed-out Tool child → interaction.tool.process_failed)."""
    log = CallLog()
    tool = ProbeTool("slow", log)
    gate = tool.hold("s1")
    program = interaction(ScriptedModel([tool_round(call("s1", "slow")), final("x")]), [tool])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        assert gate.entered.wait(WAIT)
        child = child_by_key(runtime.capture(handle.tree_id), "interaction.tool.1.0")
        getattr(runtime, control)(child.process_id, reason)
        result = handle.result(WAIT)
    assert result.status == "failed"
    assert failure_of(result) == {
        "kind": "execution",
        "code": "interaction.tool.process_failed",
        "message": f"Tool child {child.process_id} ended with {status} ({cause}): {reason}",
    }


def test_i26_a_tool_child_failure_after_a_success_prefix_propagates_unchanged_and_stays_restorable(
    local_store_url: str,
) -> None:
    """Scope ``child_batch_test.go`` (child Failure propagates unchanged; failure after a success prefix restorable).

    Round [ok, boom] run one at a time: the first call succeeds, the second call's Tool
    child fails (its settlement is a definite host failure). The Interaction fails with
    the child's Failure unchanged; the stored history folds again into a state whose
    round keeps the first result, and SettledResults reports it.
    Adaptation: the child's own Failure comes from a ``Settlement.failed`` of the tool
    dispatcher (interaction.host.failed), wrapped around the real ToolDispatcher.
    """
    log = CallLog()
    program = interaction(ScriptedModel([tool_round(call("ok", "probe"), call("boom", "probe")), final("x")]),
                          [ProbeTool("probe", log)])
    tools = tool_program(program)
    real = tools.dispatcher

    class HostRefuses:
        """The host refuses the second call before any external work (a definite failure)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def dispatch(self, request: Any, context: Any) -> Settlement:
            if request.payload["tool_call"]["invocation"]["call"]["id"] == "boom":
                return Settlement.failed("the credentials for this call were revoked")
            return real.dispatch(request, context)

    object.__setattr__(tools, "dispatcher", HostRefuses())
    try:
        store = EventStore(local_store_url)
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, chat_input("go"))
            result = handle.result(WAIT)
            tree = runtime.capture(handle.tree_id)
        again = _reloaded_root(store, program, handle.tree_id)
        store.close()
    finally:
        object.__setattr__(tools, "dispatcher", real)
    boom = child_by_key(tree, "interaction.tool.1.1")
    assert boom.termination.failure.to_json() == failure_of(result) == {
        "kind": "external", "code": "interaction.host.failed", "message": "the credentials for this call were revoked"}
    state = again.root.state
    assert isinstance(state, InteractionState) and state.to_json() == tree.root.state.to_json()
    assert [r["disposition"] for r in state.round.results] == ["succeeded"]
    assert [(e.tool_call_index, e.disposition) for e in only_round(again).entries] == [(0, "succeeded")]
    assert log.count() == 1


def test_a_scripted_model_serving_many_runs_keeps_only_its_recent_requests() -> None:
    # Found by a scale audit: a scenario's model serves every run of that scenario in a
    # long-lived process (`serve`, a worker), and its request log grew with every run
    # (~25 MB per 5,000 runs).
    from agentfold.adapters.models import ModelRequest, ScriptedModel

    model = ScriptedModel([{"content": [{"type": "text", "text": "done"}]}], keep_requests=3)
    for n in range(10):
        request = ModelRequest(process_id=f"process:{n:032x}", model_call_sequence=1,  # type: ignore[arg-type]
                               effect_id="effect:" + f"{n:064x}", attempt_id=None, messages=())  # type: ignore[arg-type]
        assert model.call(request)["content"][0]["text"] == "done"
    assert [r.process_id for r in model.requests] == [f"process:{n:032x}" for n in (7, 8, 9)]
    assert ScriptedModel([]).keep_requests == 256
