"""FirstSuccess: a competition among exact child requests (the Scope ``coordination``
package's ``FirstSuccess``; scope-interaction-team-agentrun.md section 8.4).

The input is a non-empty list of candidates ``{"key", "program", "input", "budget"?,
"capabilities"?}``, each naming one of the bound candidate Programs. The first Step declares
one child start per candidate, in request order. Every start receipt is kept (a failed start is
an explicit result, not a failure of the competition); once **all** starts have settled the
competition waits (boundary ``terminal_result``, condition ``any``) for its running candidates.
Each satisfaction's outcomes are read in request order: the first completed candidate that the
pure ``accept(key, outcome)`` predicate accepts wins. A winner, or no candidate left running,
completes the competition with ``{"winner"?, "candidates": [...]}``: per candidate, in request
order, its start receipt (a failed start, or a candidate still running when the winner was
chosen) or its terminal outcome. Completing cancels the candidates still running (the kernel's
termination rule); ``winner`` absent means no candidate satisfied ``accept``, a business
result. A slow start delays the choice even when an earlier candidate has already finished;
when several results arrive together, request order decides, not their completion times.

State: ``{"candidates", "results"?, "wait_id"?, "winner"?}``. No phase is stored: it follows
from the results, the wait and the winner. Facts name what happened (``declare``, ``starts``,
``wait``, ``outcomes`` with the winner); the fold reads receipts and outcomes from the consumed
signals, so history holds each once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentfold.domain.budget import Budget
from agentfold.domain.canonical import JSON
from agentfold.domain.coordination import DEFINITION_INVALID, INPUT_INVALID, protocol_error, state_error
from agentfold.domain.errors import ClassifiedError, FailureKind, InvalidInput, recorded_text
from agentfold.domain.ids import ChildKey, ProcessID, WaitKey
from agentfold.domain.program import (
    Boundary,
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Program,
    Signal,
    Step,
    Wait,
    check_description,
    start_child_effect,
    wait_children_effect,
)
from agentfold.domain.team import is_child_start, is_satisfied, is_wait_opened

WAIT_KEY_PREFIX = "coordination.first_success."
ACCEPT_FAILED = "coordination.accept.failed"
#: The most candidates one FirstSuccess may be configured to start (``max_candidates``).
MAX_CANDIDATES = 1024
_CANDIDATE_FIELDS = frozenset({"key", "program", "input", "budget", "capabilities"})

#: ``accept(key, outcome) -> bool``: whether a completed candidate satisfies the goal. It runs
#: inside a Step: it must be pure, deterministic and quick (it is not run again on recovery:
#: the winner is a recorded fact). ``outcome`` is the child's terminal outcome
#: (``{"key", "process_id", "boundary", "result": {"status", "output", ...}}``).
AcceptFn = Callable[[str, dict[str, Any]], bool]

_RECEIPT: JSON = {"type": "object"}

OUTPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["candidates"],
    "additionalProperties": False,
    "properties": {
        "winner": {"type": "integer", "minimum": 0},
        "candidates": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "minProperties": 1,
                "maxProperties": 1,
                "properties": {"start": _RECEIPT, "outcome": _RECEIPT},
            },
        },
    },
}


def input_schema(names: Sequence[str], max_candidates: int) -> JSON:
    """The competition's input: 1 to ``max_candidates`` requests for the bound ``names``."""
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": max_candidates,
        "items": {
            "type": "object",
            "required": ["key", "program"],
            "additionalProperties": False,
            "properties": {
                "key": {"type": "string", "minLength": 1},
                "program": {"enum": list(names)},
                "input": True,
                "budget": {"type": "object"},
                "capabilities": {"type": "array", "items": {"type": "string"}},
            },
        },
    }


def _running(result: Any) -> bool:
    return isinstance(result, dict) and "start" in result and "process_id" in result["start"]


def _admitted(results: Sequence[Any]) -> int:
    """How many results hold their start receipt (receipts fill them in request order)."""
    for index, result in enumerate(results):
        if result is None:
            return index
    return len(results)


def _result_problem(result: Any, key: str) -> str | None:
    """What is wrong with one stored candidate result (a start receipt or an outcome), or None."""
    if not isinstance(result, dict) or len(result) != 1 or not isinstance(next(iter(result.values())), dict):
        return "is not {start} or {outcome}"
    if "start" in result:
        start = result["start"]
        if start.get("key") != key:
            return "names another key"
        if not (isinstance(start.get("process_id"), str) or isinstance(start.get("failure"), dict)):
            return "is a start receipt with neither a process nor a failure"
        return None
    if "outcome" not in result:
        return "is not {start} or {outcome}"
    outcome = result["outcome"]
    if outcome.get("key") != key or not isinstance(outcome.get("process_id"), str):
        return "is an outcome of another child"
    if not isinstance(outcome.get("result"), dict) or not isinstance(outcome["result"].get("status"), str):
        return "is an outcome without a result"
    return None


def _observed(results: Sequence[Any]) -> int:
    return sum(1 for r in results if isinstance(r, dict) and "outcome" in r)


class FirstSuccessStrategy:
    """decide/evolve of a FirstSuccess Process (module docstring)."""

    def __init__(self, name: str, description: str, candidates: Sequence[Program], max_candidates: int,
                 accept: AcceptFn) -> None:
        if (not isinstance(max_candidates, int) or isinstance(max_candidates, bool)
                or not 1 <= max_candidates <= MAX_CANDIDATES):
            raise InvalidInput(DEFINITION_INVALID,
                               f"max_candidates is {max_candidates!r}; it must be an int from 1 to {MAX_CANDIDATES}",
                               hint="bound how many candidates one competition may start")
        if not callable(accept):
            raise InvalidInput(DEFINITION_INVALID, "a FirstSuccess needs an accept(key, outcome) predicate",
                               hint="e.g. lambda key, outcome: True accepts the first candidate that completes")
        if not candidates:
            raise InvalidInput(DEFINITION_INVALID, "a FirstSuccess needs at least one candidate Program")
        check_description(description, f"the description of FirstSuccess {name!r}", DEFINITION_INVALID)
        by_name: dict[str, Program] = {}
        for program in candidates:
            if not isinstance(program, Program):
                raise InvalidInput(DEFINITION_INVALID, f"a candidate is a Program, got {type(program).__name__}")
            if program.descriptor.name in by_name:
                raise InvalidInput(DEFINITION_INVALID, f"two candidate Programs are named {program.descriptor.name!r}",
                                   hint="the input names candidates by Program name: give each a distinct name")
            by_name[program.descriptor.name] = program
        self.programs = by_name
        self.max_candidates = max_candidates
        self.accept = accept
        self.descriptor = Descriptor(name, description, input_schema(list(by_name), max_candidates), OUTPUT_SCHEMA, None)

    # -- state ---------------------------------------------------------------

    def initial(self, input: JSON) -> dict[str, Any]:
        candidates = self._candidates(input)
        return {"candidates": candidates}

    def _candidates(self, input: Any) -> list[dict[str, Any]]:
        """Check the requests beyond the schema: keys, unique keys, budgets (classified errors)."""
        if not isinstance(input, list) or not 1 <= len(input) <= self.max_candidates:
            raise InvalidInput(INPUT_INVALID, f"a competition takes a list of 1 to {self.max_candidates} candidates")
        seen: set[str] = set()
        out = []
        for index, request in enumerate(input):
            if not isinstance(request, dict) or request.get("program") not in self.programs:
                raise InvalidInput(INPUT_INVALID, f"candidate {index} names no bound Program "
                                   f"(one of {sorted(self.programs)})")
            if not isinstance(request.get("key"), str) or set(request) - _CANDIDATE_FIELDS:
                raise InvalidInput(INPUT_INVALID, f"candidate {index} is {{key, program, input?, budget?, capabilities?}}")
            key = str(ChildKey(request["key"]))
            if key in seen:
                raise InvalidInput(INPUT_INVALID, f"candidate key {key!r} is used twice",
                                   hint="give each candidate its own key")
            seen.add(key)
            Budget.from_json(request.get("budget"))
            capabilities = request.get("capabilities", [])
            if not isinstance(capabilities, list) or not all(isinstance(c, str) and c for c in capabilities):
                raise InvalidInput(INPUT_INVALID, f"candidate {index}'s capabilities are a list of non-empty strings")
            out.append(dict(request))
        return out

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        """A stored (snapshot) state, checked as Scope's Restore checks it: every state the
        Strategy produces passes; a forged or damaged one is refused (coordination.state.invalid)."""
        if not isinstance(data, dict) or "candidates" not in data or set(data) - {"candidates", "results", "wait_id", "winner"}:
            raise state_error(f"not a FirstSuccess state: {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        try:
            candidates = self._candidates(data["candidates"])
        except InvalidInput as exc:
            raise state_error(f"a FirstSuccess state's candidates are invalid: {exc.message}") from None
        results, wait_id, winner = data.get("results"), data.get("wait_id"), data.get("winner")
        if results is None:
            if wait_id is not None or winner is not None:
                raise state_error("a FirstSuccess state waits or has a winner before it started its candidates")
            return data
        if not isinstance(results, list) or len(results) != len(candidates):
            raise state_error("a FirstSuccess state has one result per candidate")
        admitted = _admitted(results)
        for index, result in enumerate(results):
            if result is None:
                continue
            if index >= admitted:
                raise state_error("a start receipt follows a missing one")
            problem = _result_problem(result, candidates[index]["key"])
            if problem:
                raise state_error(f"candidate {index}'s result {problem}")
            if "outcome" in result and admitted < len(results):
                raise state_error("an outcome precedes the last start receipt")
        if winner is not None:
            if (not isinstance(winner, int) or isinstance(winner, bool) or not 0 <= winner < len(results)
                    or "outcome" not in (results[winner] or {})
                    or results[winner]["outcome"]["result"]["status"] != "completed"):
                raise state_error(f"winner {winner!r} is no completed candidate")
            if wait_id is not None:
                raise state_error("a FirstSuccess with a winner keeps no wait")
        if wait_id is not None:
            if not isinstance(wait_id, str) or not wait_id.startswith("wait:"):
                raise state_error(f"wait_id {wait_id!r} is no wait id")
            if admitted < len(results) or not any(_running(r) for r in results):
                raise state_error("a FirstSuccess waits before its starts settled, or with nobody running")
        return data

    # -- the fold --------------------------------------------------------------

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        op = facts.get("op") if isinstance(facts, dict) else None
        s = dict(state)
        if op == "declare":
            s["results"] = [None] * len(s["candidates"])
        elif op == "starts":
            results = list(s["results"])
            at = _admitted(results)
            for signal in consumed:
                if not is_child_start(signal):
                    raise state_error(f"signal {signal.id} is no start receipt")
                if at >= len(results):
                    raise state_error("more start receipts than candidates")
                results[at] = {"start": signal.payload}
                at += 1
            s["results"] = results
        elif op == "outcomes":
            satisfied = next((c for c in consumed if is_satisfied(c) and c.wait_id == s.get("wait_id")), None)
            if satisfied is None:
                raise state_error("the step consumed no satisfaction of the competition's wait")
            results = list(s["results"])
            index = {r["start"]["process_id"]: i for i, r in enumerate(results) if _running(r)}
            for outcome in satisfied.payload["outcomes"]:
                found = index.get(outcome.get("process_id"))
                if found is None:
                    raise state_error(f"outcome of {outcome.get('process_id')} names no running candidate")
                results[found] = {"outcome": outcome}
            s["results"] = results
            s.pop("wait_id", None)
            winner = facts.get("winner")
            if winner is not None:
                s["winner"] = winner
        elif op == "wait":
            opening = next((c for c in consumed if is_wait_opened(c)), None)
            if opening is None:
                raise state_error("the step consumed no opening of the competition's wait")
            s["wait_id"] = opening.wait_id
        else:
            raise state_error(f"unknown FirstSuccess fact {facts!r}")
        return s

    # -- decide --------------------------------------------------------------

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        results = state.get("results")
        if results is None:
            if window:
                raise protocol_error(f"signal {window[0].id} arrived before the competition started its candidates")
            effects = tuple(start_child_effect(self._spec(c)) for c in state["candidates"])
            return self._step(state, 0, Continue(effects), {"op": "declare"}, ())
        pending = len(results) - _admitted(results)
        if state.get("winner") is not None or (not pending and not any(_running(r) for r in results)):
            raise state_error("a finished competition takes no more Steps")
        if pending:
            # The kernel delivers a batch's receipts together, once every start has settled.
            taken = list(window[:pending])
            if len(taken) < pending or not all(is_child_start(s) for s in taken):
                raise protocol_error(f"the competition expected its {pending} candidates' start receipts")
            return self._after(state, taken, {"op": "starts"})
        wait_id = state.get("wait_id")
        if wait_id is None:
            if not window or not is_wait_opened(window[0]):
                raise protocol_error("the competition expected the opening of its wait")
            return self._step(state, 1, Wait(window[0].wait_id), {"op": "wait"}, window[:1])  # type: ignore[arg-type]
        if not window or not (is_satisfied(window[0]) and window[0].wait_id == wait_id):
            raise protocol_error(f"the competition expected the satisfaction of its wait {wait_id}")
        satisfied = window[0]
        winner = self._winner(state, satisfied)
        facts: dict[str, Any] = {"op": "outcomes"} if winner is None else {"op": "outcomes", "winner": winner}
        return self._after(state, [satisfied], facts)

    def _winner(self, state: dict[str, Any], satisfied: Signal) -> int | None:
        results = state["results"]
        index = {r["start"]["process_id"]: i for i, r in enumerate(results) if _running(r)}
        for outcome in satisfied.payload["outcomes"]:  # in request order (the wait lists them so)
            at = index.get(outcome.get("process_id"))
            if at is None:
                raise protocol_error(f"outcome of {outcome.get('process_id')} names no running candidate")
            if (outcome.get("result") or {}).get("status") != "completed":
                continue
            key = state["candidates"][at]["key"]
            try:
                accepted = self.accept(key, copy.deepcopy(outcome))  # the stored outcome stays as it is
            except Exception as exc:  # the predicate's failure fails the Step
                raise ClassifiedError(FailureKind.EXECUTION, ACCEPT_FAILED,
                                      f"accept({key!r}) raised {type(exc).__name__}: {recorded_text(exc)}") from exc
            if not isinstance(accepted, bool):
                raise ClassifiedError(FailureKind.EXECUTION, ACCEPT_FAILED,
                                      f"accept({key!r}) returned {type(accepted).__name__}, not a bool")
            if accepted:
                return at
        return None

    def _after(self, state: dict[str, Any], consumed: Sequence[Signal], facts: dict[str, Any]) -> Step:
        """Record the consumed receipts or outcomes; then complete or wait for the running candidates."""
        after = self.evolve(state, facts, consumed)
        results = after["results"]
        running = [r["start"]["process_id"] for r in results if _running(r)]
        if after.get("winner") is not None or not running:
            return Step(len(consumed), Complete(self.output(after)), facts, next_state=after)
        spec = ChildWaitSpec(WaitKey(f"{WAIT_KEY_PREFIX}{_observed(results)}"), tuple(ProcessID(p) for p in running),
                             Boundary.TERMINAL_RESULT, "any")
        return Step(len(consumed), Continue((wait_children_effect(spec),)), facts, next_state=after)

    def _step(self, state: dict[str, Any], consumed: int, transition: Any, facts: dict[str, Any],
              window: Sequence[Signal]) -> Step:
        return Step(consumed, transition, facts, next_state=self.evolve(state, facts, window))

    def _spec(self, candidate: Mapping[str, Any]) -> ChildSpec:
        program = self.programs[candidate["program"]]
        return ChildSpec(ChildKey(candidate["key"]), program.ref, candidate.get("input"),
                         Budget.from_json(candidate.get("budget")), frozenset(candidate.get("capabilities", ())))

    @staticmethod
    def output(state: Mapping[str, Any]) -> dict[str, JSON]:
        out: dict[str, JSON] = {"candidates": list(state["results"])}
        if state.get("winner") is not None:
            out["winner"] = state["winner"]
        return out


__all__ = ["ACCEPT_FAILED", "MAX_CANDIDATES", "OUTPUT_SCHEMA", "WAIT_KEY_PREFIX", "AcceptFn", "FirstSuccessStrategy"]
