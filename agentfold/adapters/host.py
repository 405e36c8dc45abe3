"""What a host does to runs: answer a tool's input wait, steer an Interaction, settle an unknown Effect.

One set of rules for the three front ends: Python (:class:`Host`), the CLI (``agentfold
answer``, ``steer``, ``resolve``) and the HTTP API. Each rule is checked against the
tree as stored before anything is appended: a refused answer or resolution leaves the
store exactly as it was (and does not even make the caller take the tree over).

Python hosts use :class:`Host` (docs/python.md)::

    host = Host(runtime)
    for entry in host.unknown():                       # the same JSON entries as GET /unknown-effects
        host.resolve(entry["effect_id"], output={"confirmation": "H-1042"})
    for entry in host.pending():                       # the same JSON entries as GET /pending-inputs
        host.answer(entry["process_id"], entry["wait_id"], {"approved": True})
    host.steer(root_process_id, "Prefer a window seat.")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import steer_signal
from agentfold.adapters.queries import HostQueries, ListingPage, parse_runs_cursor
from agentfold.adapters.resolution import ABSENT, settlement_for
from agentfold.adapters.runtime import RandomIds, Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.canonical import JSON, MAX_TOOL_INPUT_BYTES, normalize
from agentfold.domain.coordination import INPUT_WAIT_KEY
from agentfold.domain.errors import InvalidInput, NotFound, Rejected
from agentfold.domain.ids import EffectID, ProcessID, SignalID, TreeID, WaitID, parse_effect_id, parse_wait_id
from agentfold.domain.interaction.tool_call import ToolCallState
from agentfold.domain.kernel import Kernel, brief_repr
from agentfold.domain.program import ProgramResolver, SignalRequest, host_signal_id
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import CLASSIFICATIONS, STATUSES, TreeState
from agentfold.projections.host_views import gate_inputs, pending_tool_inputs
from agentfold.projections.read_models import Entry

RESOLUTION_HINT = (
    'the entry\'s "kind" in Host.unknown() says what to give: a "tool" call output= (and disposition= '
    '"succeeded", "failed" or "rejected"), a "model" call model_response=, a "context" preparation output= '
    '(the list of prepared messages), any other effect output= '
    '(and status= "succeeded" or "failed")'
)
"""What a refused :meth:`Host.resolve` is told to give instead (``host.resolution_invalid``)."""


OWN_WAIT_HINT = (
    "answer a Program's own wait from Python: runtime.deliver_signals(process_id, "
    "[SignalRequest(signal_id, payload, wait_id=wait_id)]), the payload matching the wait's response_schema"
)
"""How to answer a wait the Program opened itself (``wait_effect``), which Host.answer does not take."""


#: A page larger than this is taken as this: every entry a store could list, and within the
#: 64-bit integers SQL takes (a larger ``limit`` raised a bare OverflowError from the database).
MAX_PAGE_LIMIT = 2**31

def fresh_signal_id(prefix: str) -> SignalID:
    """A signal id for an answer or a steer the caller did not name (``answer:<32 hex>``)."""
    return SignalID(f"{prefix}:{os.urandom(16).hex()}")


def wait_state(tree: TreeState, process_id: ProcessID, wait_id: WaitID) -> dict[str, Any] | None:
    """What a wait holds now: open, answered (and by which signal id), or closed unanswered."""
    process = tree.processes.get(process_id)
    wait = process.waits.get(wait_id) if process is not None else None
    if process is None or wait is None:
        return None
    answered_by = None
    if wait.answered_by is not None:
        # Host signals stay in the mailbox as receipts once consumed: their ids remain.
        record = next((r for r in process.mailbox if r.arrival == wait.answered_by), None)
        answered_by = record.signal_id if record is not None else None
    state = "answered" if wait.answered_by is not None else ("closed" if wait.closed else "open")
    return {"wait_id": wait_id, "process_id": process_id, "state": state, "answered_by": answered_by}


def answered_elsewhere(process_id: ProcessID, wait_id: WaitID, state: dict[str, Any]) -> Rejected:
    return Rejected(
        "engine.signal.rejected",
        f"wait {wait_id} of process {process_id} was already answered (by {state['answered_by']})",
        "read the run to see how it went on; resend with that signal id and answer to retry it",
        wait=state,
    )


def answer_signal(
    tree: TreeState, programs: ProgramResolver | None, process_id: ProcessID, wait_id: WaitID, response: JSON,
    signal_id: SignalID | None, *, listing_hint: str,
) -> SignalRequest:
    """The signal that answers a Tool child's current input wait, checked against the wait's
    response schema and 1 MiB; refused (``engine.signal.rejected``) when the wait is not a
    pending tool input of that process, and (``engine.program.unavailable``) when the tree was
    folded without its Programs (``programs`` None): its waits cannot be read then.

    A signal id already admitted by the process is a retry: its signal is handed to the
    kernel as it is, which deduplicates identical content (accepted false) and refuses a
    different answer under the same id (``engine.signal.conflict``).
    """
    # A malformed request is refused as such, whatever the wait's state (an answer to a wait
    # answered meanwhile was a 409 although its signal id or answer could never be admitted).
    if signal_id is not None:
        host_signal_id(signal_id)
    normalize(response, limit=MAX_TOOL_INPUT_BYTES, what="answer")  # payload.invalid, payload.too_large over 1 MiB
    if programs is None:
        process = tree.processes.get(process_id)
        program = process.program.name if process is not None else "?"
        wait = process.waits.get(wait_id) if process is not None else None
        of_gate = wait is not None and wait.kind == "external" and wait.key == INPUT_WAIT_KEY
        raise NotFound(
            "engine.program.unavailable",
            f"the Program of process {process_id} ({program}) is not bound here: its "
            f"{'InputGate waits' if of_gate else 'tool input waits'} cannot be read",
            hint="answer from a process that binds the run's Programs (docs/python.md)",
        )
    process = tree.processes.get(process_id)
    ending = tree.ending(process) if process is not None and not process.terminal else None
    if ending is not None:
        # A cancel, kill or deadline recorded on it or an ancestor, not carried out yet: its
        # waits are no longer listed, and the kernel would refuse the signal.
        raise Rejected(
            "engine.process.finished",
            f"process {process_id} is terminating ({ending}): its wait {wait_id} takes no answer",
            hint="nothing to answer: read the run to see how it ends",
        )
    known = process.waits.get(wait_id) if process is not None else None
    if known is not None and known.kind == "external" and known.key == INPUT_WAIT_KEY:
        # An InputGate's wait (docs/team.md): its answer is the payload itself.
        if signal_id is not None and process is not None and signal_id in process.signal_index:
            return SignalRequest(signal_id, normalize(response, limit=MAX_TOOL_INPUT_BYTES, what="gate answer"), wait_id)
        gate = next((g for g in gate_inputs(tree) if g.process_id == process_id and g.wait_id == wait_id), None)
        if gate is not None:
            return gate.answer_signal(signal_id or fresh_signal_id("answer"), response)
    elif signal_id is not None and process is not None and signal_id in process.signal_index:
        value = normalize(response, limit=MAX_TOOL_INPUT_BYTES, what="tool input answer")
        return SignalRequest(signal_id, {"input_response": value}, wait_id)
    match = next((p for p in pending_tool_inputs(tree) if p.process_id == process_id), None)
    if match is None or match.wait_id != wait_id:
        state = wait_state(tree, process_id, wait_id)
        if state is not None and state["state"] == "answered":
            raise answered_elsewhere(process_id, wait_id, state)
        wait = process.waits.get(wait_id) if process is not None else None
        if process is not None and wait is not None and wait.kind == "external" and wait.key != INPUT_WAIT_KEY and not (
            process.has_state and isinstance(process.state, ToolCallState)
        ):
            # A wait the process's own Program opened (wait_effect): not a tool's input, so
            # there is no tool input to answer; the kernel admits an answer addressed to it.
            raise Rejected(
                "engine.signal.rejected",
                f"wait {wait_id} is a wait of the Program of process {process_id} ({process.program.name}) itself, "
                "not a tool's input: answer (Host.answer, `agentfold answer`, POST .../answer) takes tool inputs only",
                hint=OWN_WAIT_HINT,
                wait=state,
            )
        if process is not None and process.terminal and wait is not None:
            # Its wait was never answered, and never will be: as deliver_signals and steer say it.
            raise Rejected(
                "engine.process.finished", f"process {process_id} already ended {process.status}: its wait "
                f"{wait_id} takes no answer", hint="nothing to answer: read the run to see how it ended", wait=state,
            )
        current = process.current_wait if process is not None else None
        raise Rejected(
            "engine.signal.rejected",
            f"wait {wait_id} is not a pending input (a tool's or an InputGate's) of process {process_id}"
            + (f" (its current wait is {current})" if current else ""),
            hint=listing_hint,
            wait=state,
        )
    return match.response_signal(signal_id or fresh_signal_id("answer"), response)


def deliver_answer(runtime: Runtime, tree_id: TreeID, process_id: ProcessID, signal: SignalRequest) -> bool:
    """Deliver an answer built by :func:`answer_signal`; when another answer won the race for
    the wait meanwhile, the refusal says which signal id answered it (``wait`` member)."""
    try:
        return runtime.deliver_signals(process_id, [signal])
    except Rejected as exc:
        if exc.code not in ("engine.signal.rejected", "engine.process.finished") or signal.wait_id is None:
            raise
        # The owner refuses the loser inside the cycle that appends the winner; capture waits
        # for that cycle, so the state shown is the committed one, winner included.
        state = wait_state(runtime.capture(tree_id), process_id, signal.wait_id)
        if state is not None and state["state"] == "answered":
            # Whether the winner's Tool child has finished by now or not, the loser hears the
            # same thing: the wait was answered by someone else.
            raise answered_elsewhere(process_id, signal.wait_id, state) from exc
        raise Rejected(exc.code, exc.message, exc.hint, wait=state) from exc


def unknown_effect_tree(store: EventStore, effect_id: EffectID, *, listing_hint: str, where: str = "this store") -> TreeID:
    """The tree holding ``effect_id`` as an unknown Effect (per the tree index), else
    ``engine.effect.not_pending``: it does not exist, or its outcome is not unknown (any more)."""
    tree_id = store.tree_of_unknown_effect(effect_id)
    if tree_id is None:
        raise NotFound("engine.effect.not_pending", f"effect {effect_id} is not an unknown effect of any tree in {where}",
                       hint=f"{listing_hint} (the effect is looked up in the tree index: a run whose index row was "
                       "damaged is not found by it, and reading that run is refused as store.corrupt)")
    return tree_id


def checked_resolution(tree: TreeState, effect_id: EffectID, settlement: Settlement) -> ProcessID | None:
    """Apply the kernel's resolution rules to a private fold (``tree`` is changed): the Process
    of the unknown Effect, or the kernel's refusal (not unknown, already resolved, ...)."""
    found = tree.find_effect(effect_id)
    process_id = found[0].process_id if found is not None else None
    Kernel(tree, lambda ref: None, RandomIds()).resolve_effect(
        effect_id, settlement.status, settlement.payload, process_id=process_id
    )
    return process_id


def _entries(queries: HostQueries, listing: Callable[..., list[Entry]], page: Callable[..., ListingPage],
             tree: str | None, limit: int | None, after: str | None) -> list[Entry]:
    """One run's entries (``listing(tree)``), every run's (``listing()``), or a page of them."""
    paged = limit is not None or after is not None
    if tree is not None:
        if paged:
            raise InvalidInput("host.page_invalid", "one run's listing is not paged: limit and after list every run",
                               hint="drop tree to page through every run, or drop limit and after")
        return listing(queries.tree_of(tree))
    if not paged:
        return listing()
    if after is not None and not isinstance(after, str):
        raise InvalidInput("host.page_invalid", f"after must be a cursor (a string: a page's next_after), got {brief_repr(after)}",
                           hint="pass the next_after of the previous page, or leave after out for the first page")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidInput("host.page_invalid", f"limit must be a positive integer, got {brief_repr(limit)}",
                           hint="pass a whole number of entries per page, at least 1 (e.g. limit=100)")
    return page(limit=100 if limit is None else min(limit, MAX_PAGE_LIMIT), after=after)


class Host:
    """A host service's view of a Runtime's store, in Python: the questions of
    :class:`~agentfold.adapters.queries.HostQueries` (the same JSON entries as the HTTP API) and the
    actions of ``agentfold answer``, ``steer`` and ``resolve``, with the same rules and
    error codes. Actions go through ``runtime``: it adopts a run nobody owns, or hands the
    input to the live runtime that owns it.

    ``sources``: Programs and loaders to bind into ``runtime``'s catalog, for runs it did not
    start (a host process that only answers and resolves): without their exact Program a
    run's calls cannot be interpreted, and actions on it are refused
    (``engine.program.unavailable``).
    """

    def __init__(self, runtime: Runtime, sources: ProgramSources | None = None) -> None:
        if not isinstance(runtime, Runtime):
            raise InvalidInput(
                "runtime.invalid", f"a Host works through a Runtime, not {type(runtime).__name__}",
                hint="pass Runtime(EventStore(url), Catalog([...])) (agentfold.adapters.runtime); "
                "a host that only reads can use HostQueries",
            )
        if sources is not None and not isinstance(sources, ProgramSources):
            raise InvalidInput(
                "runtime.invalid", f"a Host's sources are ProgramSources, not {type(sources).__name__}",
                hint="pass ProgramSources(programs=(program, ...)) (agentfold.adapters.sources), or bind the "
                "Programs in the Runtime's Catalog",
            )
        self.runtime = runtime
        if sources is not None:
            for program in sources.programs:
                runtime.catalog.add(program)
            runtime.catalog.add_loaders(sources.loaders)

    def queries(self) -> HostQueries:
        """Host questions answered with every Program the runtime has bound by now."""
        return HostQueries(self.runtime.store, ProgramSources(), catalog=self.runtime.catalog)

    # -- questions ---------------------------------------------------------------

    def unknown(self, tree: str | None = None, *, limit: int | None = None, after: str | None = None) -> list[Entry]:
        """Effects whose outcome is unknown, waiting for :meth:`resolve`: of one run, of all,
        or (``limit``) a page of all as ``GET /unknown-effects`` (a :class:`ListingPage`: page
        on with its ``next_after``)."""
        queries = self.queries()
        return _entries(queries, queries.unknown, queries.unknown_page, tree, limit, after)

    def pending(self, tree: str | None = None, *, limit: int | None = None, after: str | None = None) -> list[Entry]:
        """Tool calls waiting for a human's :meth:`answer`: of one run, of all, or (``limit``)
        a page of all as ``GET /pending-inputs`` (see :meth:`unknown`)."""
        queries = self.queries()
        return _entries(queries, queries.pending, queries.pending_page, tree, limit, after)

    def runs(self, *, status: str | None = None, classification: str | None = None, limit: int = 100,
             after: str | None = None) -> list[Entry]:
        """Runs in creation order (``GET /runs``): ``status`` as the kernel names it
        (``running``, ``waiting``, ``completed``, ...), ``classification`` (``progress``,
        ``parked``, ``terminal``); page on with the last entry's ``cursor`` (a string, as
        ``GET /runs`` returns it: ``m...`` from the read models, ``f...`` from folding)."""
        if status is not None and status not in STATUSES:
            raise InvalidInput("host.page_invalid", f"status must be one of {', '.join(STATUSES)}, got {brief_repr(status)}",
                               hint="pass a status as the kernel names it, or leave status out for every run")
        if classification is not None and classification not in CLASSIFICATIONS:
            raise InvalidInput("host.page_invalid",
                               f"classification must be one of {', '.join(CLASSIFICATIONS)}, got {brief_repr(classification)}",
                               hint="pass a classification, or leave classification out for every run")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInput("host.page_invalid", f"limit must be a positive integer, got {brief_repr(limit)}",
                               hint="pass a whole number of runs per page, at least 1 (e.g. limit=100)")
        limit = min(limit, MAX_PAGE_LIMIT)
        given: object = after
        if type(given) is int and given == 0:  # the first page, as releases before 2026-12-02 wrote it
            after = None
        problem = None if after is None or isinstance(after, str) else "must be a cursor (a string)"
        if problem is None:
            try:
                parse_runs_cursor(after)
            except InvalidInput:
                problem = "is not a cursor Host.runs returned"
        if problem is not None:
            raise InvalidInput("host.page_invalid", f"after {problem}: got {brief_repr(after)}",
                               hint="pass the cursor of the last run of the previous page (e.g. 'm1005' or 'f100'), "
                                    "or leave after out for the first page")
        # A ListingPage: its ``corrupt`` names a run whose history cannot be read (left out).
        return self.queries().runs_page(status=status, classification=classification, limit=limit, after=after)

    def delegates(self, process_id: str) -> Entry:
        """Which child each delegated tool call of an Interaction started (``agentfold delegates``)."""
        return self.queries().delegates(process_id)

    def run(self, tree: str) -> Entry:
        """One run's summary (``GET /runs/{tree}``): status, root process, output or failure."""
        queries = self.queries()
        return queries.run(queries.tree_of(tree))

    def results(self, tree: str) -> Entry:
        """The settled tool results of each open round (``agentfold results``)."""
        queries = self.queries()
        return queries.results(queries.tree_of(tree))

    # -- actions -------------------------------------------------------------------

    def resolve(
        self, effect_id: EffectID | str, *, output: JSON = ABSENT, disposition: str | None = None,
        status: str | None = None, model_response: JSON = ABSENT, effective_messages: JSON = ABSENT,
    ) -> Settlement:
        """Settle an unknown Effect with the outcome the host found out; returns the Settlement
        recorded.

        A tool call: ``output`` (text, or ``{"content", "details"}``) and ``disposition``
        (``succeeded``, the default, ``failed`` or ``rejected``). A model call:
        ``model_response`` (``{"message": ..., "finish_reason": ...}``), and for a Program with a
        context policy ``effective_messages`` (the messages the model received). Any other Effect:
        ``output`` and ``status`` (``succeeded``, the default, or ``failed``).
        """
        eid = parse_effect_id(effect_id)
        tree_id = unknown_effect_tree(self.runtime.store, eid, listing_hint="list unknown effects with Host.unknown()")
        probe, programs = self.queries().fold(tree_id)
        settlement = self.settlement(probe, programs, eid, output=output, disposition=disposition, status=status,
                                     model_response=model_response, effective_messages=effective_messages)
        process_id = checked_resolution(probe, eid, settlement)
        self.runtime.resolve_unknown_effect(eid, settlement, process_id=process_id)
        return settlement

    @staticmethod
    def settlement(
        tree: TreeState, programs: ProgramResolver | None, effect_id: EffectID, *, output: JSON, disposition: str | None,
        status: str | None, model_response: JSON, effective_messages: JSON = ABSENT,
    ) -> Settlement:
        def refused(message: str) -> InvalidInput:
            return InvalidInput("host.resolution_invalid", message, hint=RESOLUTION_HINT)

        return settlement_for(
            tree, programs, effect_id,
            model_response=model_response if model_response is ABSENT else normalize(model_response, what="model_response"),
            effective_messages=effective_messages if effective_messages is ABSENT
            else normalize(effective_messages, what="effective_messages"),
            output=output if output is ABSENT else normalize(output, what="output"),
            disposition=disposition, status=status, usage=refused, wrong_kind=refused,
        )

    def answer(
        self, process_id: ProcessID | str, wait_id: WaitID | str, response: JSON, *, signal_id: str | None = None
    ) -> bool:
        """Answer a Tool child's input wait (checked against its response schema) or an
        InputGate's (its answer schema; docs/team.md); True when admitted, False when this
        signal id already delivered this very answer."""
        pid, wid = ProcessID(process_id), parse_wait_id(wait_id)
        sid = SignalID(signal_id) if signal_id is not None else None
        queries = self.queries()
        tree_id = queries.tree_of_process(pid)
        tree, programs = queries.fold(tree_id)
        signal = answer_signal(tree, programs, pid, wid, response, sid, listing_hint="list pending inputs with Host.pending()")
        return deliver_answer(self.runtime, tree_id, pid, signal)

    def gates(self, tree: str | None = None, *, limit: int | None = None, after: str | None = None) -> list[Entry]:
        """The InputGates that wait for an answer (:meth:`answer_gate`): of one run (a tree id,
        start id or process id), of all, or (``limit``) a page of all as ``GET /gates`` (see
        :meth:`unknown`). Each: ``tree_id``, ``process_id``, ``wait_id``, ``request``,
        ``answer_schema``, ``parent_id`` and ``task`` (the gate's key under its collaboration).
        docs/team.md."""
        queries = self.queries()
        return _entries(queries, queries.gates, queries.gates_page, tree, limit, after)

    def answer_gate(
        self, process_id: ProcessID | str, wait_id: WaitID | str, answer: JSON, *, signal_id: str | None = None
    ) -> bool:
        """Answer an InputGate's wait (checked against its answer schema): True when admitted,
        False when this signal id already delivered this very answer. The gate completes with
        ``{"id": signal id, "wait_id", "payload": answer}``, which wakes its collaboration.
        :meth:`answer` takes gate waits as well; this name says which one is meant."""
        return self.answer(process_id, wait_id, answer, signal_id=signal_id)

    def steer(
        self, process_id: ProcessID | str, message: str | Sequence[dict[str, Any]], *, signal_id: str | None = None
    ) -> bool:
        """User message(s) for the Interaction's next model request: a text (one user message)
        or chat messages. True when admitted, False when this signal id was already admitted."""
        if not isinstance(message, str | Sequence) or isinstance(message, bytes | bytearray):
            raise InvalidInput("interaction.signal.invalid",
                               f"a steer is a text or a list of chat messages, not {type(message).__name__}",
                               hint='pass "words for the model" or [{"role": "user", "content": "..."}]')
        if isinstance(message, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": message}]
        else:
            messages = list(message)
        signal = steer_signal(SignalID(signal_id) if signal_id is not None else fresh_signal_id("steer"), *messages)
        return self.runtime.deliver_signals(ProcessID(process_id), [signal])


__all__ = [
    "Host", "answer_signal", "answered_elsewhere", "checked_resolution", "deliver_answer", "fresh_signal_id",
    "unknown_effect_tree", "wait_state",
]
