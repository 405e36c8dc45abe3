"""The pure fold of a root tree's events into its state (the TreeSnapshot).

:class:`TreeState` is rebuilt only by applying events, in order. Each ``apply``
validates the event against every rule of DESIGN.md "Rules the fold enforces" and
raises :class:`FoldError` naming the position and the broken rule; a stream that
violates a rule is corrupt. The fold is deterministic: no I/O, clock or randomness.

Deliveries the kernel derives are made here, not stored: when the last Effect of a
Step's batch settles definitely, its settlement Signals enter the mailbox in
declaration order; a child wait whose condition becomes true receives its
satisfaction Signal; a terminating parent records parent-owned terminal intents on
its live children.

When a :data:`~agentfold.domain.program.ProgramResolver` is given, the fold also keeps each
Process's Strategy state by calling ``initial`` and ``evolve``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from agentfold.domain.budget import Allocation, Budget, child_debit
from agentfold.domain.canonical import JSON, canonical_bytes, digest_of, value_at
from agentfold.domain.errors import Failure, FailureKind, recorded_text, valid_qualified_name
from agentfold.domain.events import (
    CheckpointCommitted,
    ControlRequested,
    EffectDeclared,
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    ProcessStarted,
    ProcessTerminated,
    SignalAdmitted,
    StepCommitted,
    TreeEvent,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import (
    ChildKey,
    Digest,
    EffectAttemptID,
    EffectID,
    ProcessID,
    SignalID,
    StartID,
    TreeID,
    TreeIncarnationID,
    WaitID,
    WaitKey,
    child_process_id,
    child_wait_satisfied_signal_id,
    settlement_signal_id,
    wait_id_for,
    wait_opened_signal_id,
)
from agentfold.domain.ids import (
    effect_id as derive_effect_id,
)
from agentfold.domain.input_changes import INPUT_PATCH, apply_changes, holds_input_patch, with_whole_input
from agentfold.domain.json_schema import recorded_schema_errors
from agentfold.domain.program import (
    Boundary,
    ChildWaitSpec,
    Operation,
    ProgramRef,
    ProgramResolver,
    SettlementStatus,
    Signal,
    SignalRequest,
    check_child_operation,
    program_ref_of,
)

#: Every status of a Process, live ones first.
STATUSES = ("running", "waiting", "paused", "completed", "failed", "canceled", "timed_out", "killed")
#: Every classification of a tree (``TreeState.classification``).
CLASSIFICATIONS = ("progress", "parked", "terminal")
TERMINAL = frozenset(STATUSES[3:])

CAUSE_STATUS = {
    "completion": "completed",
    "engine_kill": "killed",
    "host_deadline": "timed_out",
    "parent_deadline": "timed_out",
    "host_cancellation": "canceled",
    "parent_cancellation": "canceled",
    "execution_failure": "failed",
    "contract_failure": "failed",
    "external_failure": "failed",
    "panic": "failed",
}

def stop_intent(ending: str) -> Literal["cancel", "deadline"]:
    """The intent a live child records when its parent ends, or has to end, for ``ending``
    (the parent's terminal intent): a parent that times out gives its children a deadline,
    any other end a cancellation (spec §2.6)."""
    return "deadline" if ending == "deadline" else "cancel"


FAILURE_CAUSE = {
    FailureKind.EXECUTION: "execution_failure",
    FailureKind.CONTRACT: "contract_failure",
    FailureKind.EXTERNAL: "external_failure",
    FailureKind.PANIC: "panic",
}

INTENT_PRIORITY = ("kill", "deadline", "cancel")
#: Each SettlementStatus by its text, and every Operation's text (built once, not per event).
_SETTLEMENT_STATUS: dict[str, SettlementStatus] = {s._value_: s for s in SettlementStatus}
_OPERATIONS = frozenset(o._value_ for o in Operation)


def intent_cause(kind: str, owner: str) -> str:
    if kind == "kill":
        return "engine_kill"
    if kind == "deadline":
        return f"{owner}_deadline"
    return f"{owner}_cancellation"


class FoldError(Exception):
    """A corrupt stream: the event at ``position`` breaks ``rule``."""

    def __init__(self, position: int, rule: str, detail: str, tree_id: str | None = None) -> None:
        super().__init__(f"position {position}: {rule}: {detail}")
        self.position = position
        self.rule = rule
        self.detail = detail
        self.tree_id = tree_id

    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree_id, "position": self.position, "rule": self.rule, "detail": self.detail}


# ---------------------------------------------------------------------------
# State records


@dataclass(slots=True)
class MailboxRecord:
    arrival: int
    signal_id: SignalID
    wait_id: WaitID | None
    payload: JSON
    source: str  # host | parent | engine
    status: SettlementStatus | None = None
    effect_id: EffectID | None = None
    consumed: bool = False
    _digest: Digest | None = None
    _signal: Signal | None = field(default=None, repr=False, compare=False)
    """The record as a Step sees it, built once (transient: never serialized). Every field
    it reads is fixed while the record is pending; ``payload`` only changes (to None) when
    the record is consumed, and a consumed record is never shown to a Step again."""

    @property
    def digest(self) -> Digest | None:
        """The payload digest; a consumed engine signal keeps none (its payload is in its event)."""
        if self.consumed and self.source == "engine":
            # Even if one was cached while it was pending (to_json for show or a snapshot):
            # the state must not depend on whether it was observed mid-stream.
            return None
        if self._digest is None:
            self._digest = digest_of(self.payload)
        return self._digest

    def signal(self) -> Signal:
        if self._signal is None or self.consumed:
            signal = Signal(self.signal_id, self.payload, self.wait_id, self.status, self.effect_id)
            if self.consumed:
                return signal
            self._signal = signal
        return self._signal

    def to_json(self, with_payload: bool = True) -> dict[str, JSON]:
        """A receipt; members without a value are omitted (snapshots hold many of these)."""
        body: dict[str, JSON] = {"arrival": self.arrival, "source": self.source}
        if not (self.source == "engine" and self.effect_id is not None):
            body["signal_id"] = self.signal_id  # a settlement signal's id derives from its effect
        if self.wait_id is not None:
            body["wait_id"] = self.wait_id
        digest = self.digest
        if digest is not None:
            body["digest"] = digest
        if self.consumed:
            body["consumed"] = True
        if self.status is not None:
            body["status"] = self.status.value
        if self.effect_id is not None:
            body["effect_id"] = self.effect_id
        if not self.consumed and with_payload:
            body["payload"] = self.payload
        return body


@dataclass(slots=True)
class WaitRecord:
    wait_id: WaitID
    key: WaitKey
    kind: str  # external | children
    effect_id: EffectID
    prompt: JSON = None
    response_schema: JSON = None
    spec: ChildWaitSpec | None = None
    answered_by: int | None = None
    closed: bool = False
    satisfied: bool = False
    # Transient progress of an open child wait (never serialized; rebuilt by one scan of
    # spec.children the first time the wait is checked after a fold or from_json). Invariant
    # while the wait is open and unsatisfied: ``reached`` is the set of spec children that
    # are at the wait's boundary; each termination adds at most the child on its ancestor
    # path (TreeState._notify_waiters), so a wait over N children costs O(N) in all.
    members: frozenset[ProcessID] | None = field(default=None, repr=False, compare=False)
    reached: set[ProcessID] = field(default_factory=set, repr=False, compare=False)

    def to_json(self) -> dict[str, JSON]:
        body: dict[str, JSON] = {
            "wait_id": self.wait_id,
            "key": self.key,
            "kind": self.kind,
            "effect_id": self.effect_id,
            "answered_by": self.answered_by,
            "closed": self.closed,
        }
        if self.kind == "external":
            body["prompt"] = self.prompt
            body["response_schema"] = self.response_schema
        else:
            assert self.spec is not None
            body["spec"] = self.spec.to_json()
            body["satisfied"] = self.satisfied
        return body


@dataclass(slots=True)
class EffectRecord:
    effect_id: EffectID
    step: int
    index: int
    target: str  # framework | dispatcher
    payload: JSON
    replay: str
    capabilities: tuple[str, ...] = ()
    phase: str = "planned"  # planned | pending | settled
    status: SettlementStatus | None = None
    result: JSON = None
    diagnostic: Failure | None = None
    attempt_id: EffectAttemptID | None = None
    incarnation_id: TreeIncarnationID | None = None
    resolved_by: str | None = None
    attempts: int = 0
    input_patch: JSON = None
    """A start-child Effect stored with ``input_patch`` (its input as the changes from an earlier
    child's): that patch, as stored. ``payload`` holds the input rebuilt; storage snapshots write
    the patch, so that they hold each repeated part of a team's Turns once, as the events do."""

    @property
    def operation(self) -> str | None:
        if self.target == "framework" and isinstance(self.payload, dict):
            op = self.payload.get("operation")
            return op if isinstance(op, str) else None
        return None

    @property
    def definite(self) -> bool:
        return self.phase == "settled" and self.status is not None and self.status.definite

    @property
    def unknown(self) -> bool:
        return self.phase == "settled" and self.status is SettlementStatus.UNKNOWN

    @property
    def in_flight(self) -> bool:
        return self.phase == "pending"

    def to_json(self, compact: bool = False) -> dict[str, JSON]:
        """``compact`` (storage snapshots): with the ``input_patch`` its input was stored as."""
        body: dict[str, JSON] = {
            "effect_id": self.effect_id,
            "step": self.step,
            "index": self.index,
            "target": self.target,
            "payload": self.payload,
            "replay": self.replay,
            "phase": self.phase,
        }
        if self.capabilities:
            body["capabilities"] = list(self.capabilities)
        if self.status is not None:
            body["status"] = self.status.value
            body["result"] = self.result
        if self.diagnostic is not None:
            body["diagnostic"] = self.diagnostic.to_json()
        if self.attempt_id is not None:
            body["attempt_id"] = self.attempt_id
            body["incarnation_id"] = self.incarnation_id
            body["attempts"] = self.attempts
        if self.resolved_by is not None:
            body["resolved_by"] = self.resolved_by
        if compact and self.input_patch is not None:
            body[INPUT_PATCH] = self.input_patch
        return body


@dataclass(slots=True)
class Termination:
    status: str
    cause: str
    reason: str
    failure: Failure | None
    unresolved_effect_ids: tuple[EffectID, ...]

    def to_json(self) -> dict[str, JSON]:
        return {
            "status": self.status,
            "cause": self.cause,
            "reason": self.reason,
            "failure": self.failure.to_json() if self.failure else None,
            "unresolved_effect_ids": list(self.unresolved_effect_ids),
        }


@dataclass(slots=True)
class ProcessState:
    process_id: ProcessID
    root_id: ProcessID
    parent_id: ProcessID | None
    child_key: ChildKey | None
    depth: int
    program: ProgramRef
    input: JSON
    budget: Budget
    capabilities: tuple[str, ...]
    limits_max_pending: int
    start_effect_id: EffectID | None = None
    input_patch: JSON = None
    """The ``input_patch`` its start stored (``EffectRecord.input_patch``), or None: its input was
    stored whole. A storage snapshot writes it in place of the input (``TreeState.to_json``)."""
    status: str = "running"
    committed_steps: int = 0
    prepared_effects: int = 0
    accepted_signals: int = 0
    reserved_signals: int = 0
    allocated: Allocation = field(default_factory=Allocation)
    mailbox: list[MailboxRecord] = field(default_factory=list)
    """Pending records, preceded by consumed host and parent records (receipts). A consumed
    engine record (settlement, wait opening) is dropped: its payload lives in its event and
    its id is derived, so keeping it would only grow the state with every Step."""
    cursor: int = 0
    arrivals: int = 0
    """Records ever admitted (the next record's arrival number is ``arrivals + 1``)."""
    consumed_through: int = 0
    """Arrival number of the last consumed record."""
    signal_index: dict[SignalID, MailboxRecord] = field(default_factory=dict)
    waits: dict[WaitID, WaitRecord] = field(default_factory=dict)
    open_wait_keys: dict[WaitKey, WaitID] = field(default_factory=dict)
    current_wait: WaitID | None = None
    pause_reason: str | None = None
    intents: dict[str, tuple[str, str]] = field(default_factory=dict)
    batch: list[EffectRecord] = field(default_factory=list)
    batch_step: int = 0
    last_kind: str | None = None
    children: list[ProcessID] = field(default_factory=list)
    child_keys: dict[ChildKey, ProcessID] = field(default_factory=dict)
    termination: Termination | None = None
    output: JSON = None
    state: Any = None
    has_state: bool = False
    json_cache: tuple[Any, dict[str, Any]] | None = None
    # -- transient indexes (never serialized; from_json and the fold rebuild them) so that
    # per-event work does not scan a wide batch, a big mailbox or many children:
    frontier_at: int = field(default=0, repr=False, compare=False)
    """Index in ``batch`` of the first Effect not definitely settled (or len(batch)). An
    Effect never goes from definite back to not definite, so it only moves forward; it is
    reset to 0 whenever ``batch`` is replaced."""
    batch_index: dict[EffectID, EffectRecord] = field(default_factory=dict, repr=False, compare=False)
    """``batch`` by effect id (rebuilt when its size differs from ``batch``'s)."""
    window_cache: tuple[Signal, ...] = field(default=(), repr=False, compare=False)
    """The signals of ``mailbox[cursor : cursor + len(window_cache)]``: a prefix of the window,
    extended with new records and cut by consumption (``window``, ``_on_step_committed``)."""
    live_children: int = field(default=0, repr=False, compare=False)
    """Direct children that are not terminal (the kernel's max_active_children check)."""
    undrained_children: int = field(default=0, repr=False, compare=False)
    """Direct children whose subtree is not drained: a Process's subtree is drained when it
    is terminal and this is 0 (a terminal Process has no Effect in flight, and gets no new
    child)."""
    child_waits: dict[WaitID, WaitRecord] = field(default_factory=dict, repr=False, compare=False)
    """Every child wait that is neither closed nor satisfied, in creation order (entries that
    became closed or satisfied are dropped when next met)."""
    ordinal: int = field(default=0, repr=False, compare=False)
    """Its place in the tree's creation order (``TreeState.processes``): the kernel's order."""
    freed_wait_keys: tuple[int, frozenset[WaitKey]] = field(default=(0, frozenset()), repr=False, compare=False)
    """The last Step whose consumption closed waits, and their keys: that Step's own Effects may
    not open those keys again (the kernel checks a Step's Effects before its consumption closes
    anything: spec 2.5 step 6 and 5.3). A Step and its declarations are one append, so this never
    needs to survive a snapshot."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def pending_count(self) -> int:
        return len(self.mailbox) - self.cursor

    def pending(self) -> list[MailboxRecord]:
        return self.mailbox[self.cursor :]

    def window(self) -> tuple[Signal, ...]:
        cached = self.window_cache
        start = self.cursor + len(cached)
        if start < len(self.mailbox):
            cached = self.window_cache = cached + tuple([r.signal() for r in self.mailbox[start:]])
        return cached

    @property
    def drained(self) -> bool:
        """Terminal with every descendant terminal (``TreeState.subtree_drained``)."""
        return self.undrained_children == 0 and self.status in TERMINAL

    @property
    def terminal_intent(self) -> str | None:
        if not self.intents:  # safe: no intent recorded, none of the priorities is in it (the common case)
            return None
        for kind in INTENT_PRIORITY:
            if kind in self.intents:
                return kind
        return None

    @property
    def batch_outstanding(self) -> bool:
        return bool(self.batch)

    def frontier(self) -> EffectRecord | None:
        """The first Effect of the batch that is not definitely settled."""
        batch = self.batch
        at = self.frontier_at
        n = len(batch)
        if at > n:
            at = 0
        while at < n:
            record = batch[at]
            if not record.definite:
                self.frontier_at = at
                return record
            at += 1
        self.frontier_at = at
        return None

    def unknown_effects(self) -> list[EffectRecord]:
        # Only the frontier can be unknown or in flight: settlement, dispatch and resolution
        # act on the frontier alone, so every Effect after it is still planned.
        record = self.frontier()
        return [record] if record is not None and record.unknown else []

    def in_flight(self) -> list[EffectRecord]:
        record = self.frontier()
        return [record] if record is not None and record.in_flight else []

    def parked(self) -> bool:
        """Nothing to do without input (kernel spec 4.3): waiting, paused, or stopped by an
        unknown outcome, and no terminal intent (a Process asked to end ends without any
        input: it is progress, for an owner to carry out, even waiting or paused). A live
        tree is parked when every live Process is."""
        if self.intents and self.terminal_intent is not None:  # (at every append: the cheap test first)
            return False
        return self.status in ("waiting", "paused") or bool(self.unknown_effects())

    @property
    def runnable(self) -> bool:
        """Running, no outstanding batch, no terminal intent: the next Step may run."""
        return self.status == "running" and not self.batch and self.terminal_intent is None

    def effect(self, eid: EffectID) -> EffectRecord | None:
        index = self.batch_index
        if len(index) != len(self.batch):
            index.clear()
            index.update((r.effect_id, r) for r in self.batch)
        return index.get(eid)

    @property
    def usage(self) -> dict[str, int]:
        return {"steps": self.committed_steps, "effects": self.prepared_effects, "signals": self.accepted_signals}

    def relation_json(self) -> dict[str, JSON]:
        return {
            "process_id": self.process_id,
            "parent_id": self.parent_id,
            "root_id": self.root_id,
            "child_key": self.child_key,
            "depth": self.depth,
        }


# ---------------------------------------------------------------------------
# The fold


_MISSING: Any = object()


def _text(value: Any) -> None:
    """A stored cancel reason is text, not only whitespace (earlier releases checked reasons
    less than Steps do now: a lone surrogate or more than 4096 bytes, never a blank one)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a cancel_child reason is non-empty text, not {value!r}")


#: What must follow a Step, by what the fold expects next: (the rule, what is missing).
_UNFINISHED = {
    "declare": ("effect.declaration", "its EffectDeclared events"),
    "checkpoint": ("checkpoint.pairing", "its CheckpointCommitted"),
    "terminate": ("step.sequence", "its ProcessTerminated"),
}


class TreeState:
    """The folded state of one root tree. Mutated only by :meth:`apply`."""

    def __init__(self, programs: ProgramResolver | None = None) -> None:
        self.programs = programs
        self.tree_id: TreeID | None = None
        self.start_id: StartID | None = None
        self.root_id: ProcessID | None = None
        self.incarnation: TreeIncarnationID | None = None
        self.incarnations: list[TreeIncarnationID] = []
        self.limits = TreeLimits()
        self.configuration: JSON = None
        self.bound: dict[str, ProgramRef] = {}
        """The tree's bound ProgramRefs by digest (TreeStarted.program and .programs)."""
        self.version = 0
        self.processes: dict[ProcessID, ProcessState] = {}
        self._expect: tuple[str, ProcessID, int, int] | None = None
        self._pending_declarations = 0
        # The succeeded settlements a complete Step consumed, by effect id: where the
        # ProcessTerminated right after it may take its output from (``output_of``).
        self._completing: dict[EffectID, JSON] = {}
        self._finished_effects: set[EffectID] = set()
        self._resolved_effects: set[EffectID] = set()
        self.live: dict[ProcessID, ProcessState] = {}
        """Non-terminal Processes in creation order (kept so per-append work ignores finished ones)."""
        self.unknown_ids: set[EffectID] = set()
        """Effects whose outcome is unknown and not resolved (terminal processes keep theirs)."""
        # For Kernel.advance (transient, never serialized): the Processes an applied event may
        # have changed, as far as what the kernel decides next goes: the event's Process; a
        # start's parent; an end's ancestors (their child waits) and children (their terminal
        # intents). While an advance runs they are listed in ``touch_log``, else added to
        # ``kernel_awake``: the Processes the next advance offers a move (the others could
        # not move when last offered one, and nothing touched them since).
        self.touch_log: list[ProcessID] | None = None
        self.kernel_awake: set[ProcessID] = set()
        self.kernel_waiting: set[ProcessID] = set()
        """Processes an advance refused a dispatch permission, untouched since (Kernel.advance)."""
        self.kernel_permits: list[tuple[int, ProcessID]] = []
        """A heap of (ordinal, process id) holding every Process of ``kernel_waiting``."""

    # -- queries -----------------------------------------------------------

    @property
    def root(self) -> ProcessState:
        assert self.root_id is not None
        return self.processes[self.root_id]

    def process(self, pid: ProcessID) -> ProcessState | None:
        return self.processes.get(pid)

    def find_effect(self, eid: EffectID) -> tuple[ProcessState, EffectRecord] | None:
        for process in self.processes.values():
            record = process.effect(eid)
            if record is not None:
                return process, record
        return None

    @property
    def terminal(self) -> bool:
        return bool(self.processes) and all(p.terminal for p in self.processes.values())

    def ending(self, process: ProcessState) -> str | None:
        """Why ``process`` takes no other Step and makes no other call: a terminal intent on it
        or on an ancestor, or an ancestor that ended (None: neither). An ancestor's end reaches
        its subtree as ``ControlRequested`` events the owner's next pass appends (kernel spec
        2.6: "terminal intent stops the subtree"), so until then the stored subtree holds only
        the ancestor's: recovery, replay and resolution read it there too."""
        if process.terminal_intent is not None:
            return f"{process.terminal_intent} requested"
        pid = process.parent_id
        while pid is not None:
            ancestor = self.processes[pid]
            if ancestor.terminal:
                return f"its ancestor {pid} ended ({ancestor.status})"
            if ancestor.terminal_intent is not None:
                return f"its ancestor {pid} is ending ({ancestor.terminal_intent} requested)"
            pid = ancestor.parent_id
        return None

    def subtree(self, pid: ProcessID) -> list[ProcessState]:
        out: list[ProcessState] = []
        stack = [pid]
        while stack:
            current = self.processes[stack.pop()]
            out.append(current)
            stack.extend(reversed(current.children))
        return out

    def subtree_drained(self, pid: ProcessID) -> bool:
        return all(p.terminal and not p.in_flight() for p in self.subtree(pid))

    def subtree_unresolved(self, pid: ProcessID) -> list[EffectID]:
        ids: list[EffectID] = []
        for p in self.subtree(pid):
            ids.extend(r.effect_id for r in p.unknown_effects())
        return sorted(ids)

    def classification(self) -> str:
        """``progress``, ``parked`` or ``terminal`` (kernel spec 4.3 shared rule)."""
        if not self.live:
            return "terminal"
        for p in self.live.values():
            if not p.parked():
                return "progress"
        return "parked"

    # -- application -------------------------------------------------------

    def fail(self, position: int, rule: str, detail: str) -> FoldError:
        return FoldError(position, rule, detail, self.tree_id)

    def apply_all(self, events: Iterable[TreeEvent]) -> None:
        for event in events:
            self.apply(event)

    def apply(self, event: TreeEvent, position: int | None = None, *, next_state: Any = _MISSING) -> None:
        """Validate and apply one event at ``position`` (default: the next version)."""
        pos = self.version + 1 if position is None else position
        if pos != self.version + 1:
            raise self.fail(pos, "stream.position", f"expected position {self.version + 1}, got {pos}")
        if self.version == 0 and not isinstance(event, TreeStarted):
            raise self.fail(pos, "stream.first_event", f"the first event must be TreeStarted, got {type(event).__name__}")
        expect = self._expect
        if expect is not None:
            self._check_expectation(pos, event, expect)
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise self.fail(pos, "stream.event_type", f"unknown event type {type(event).__name__}")
        handler(self, pos, event, next_state)
        self.version = pos
        log = self.touch_log
        if log is None:
            self.kernel_awake.add(event.process_id)
        else:
            log.append(event.process_id)
        if type(event) in _RELATIVES:
            self._touch_relatives(event)  # type: ignore[arg-type]

    def _touch_relatives(self, event: ProcessStarted | ProcessTerminated) -> None:
        """See ``touch_log``: a start's parent, an end's children and ancestors."""
        touched: list[ProcessID] = []
        if isinstance(event, ProcessStarted):
            touched.append(event.parent_id)
        else:
            process = self.processes[event.process_id]
            touched.extend(process.children)
            while process.parent_id is not None:
                touched.append(process.parent_id)
                process = self.processes[process.parent_id]
        if self.touch_log is None:
            self.kernel_awake.update(touched)
        else:
            self.touch_log.extend(touched)

    def unfinished_step(self) -> tuple[int, str, str] | None:
        """Where the history breaks off inside a Step, if it does: (the position that is
        missing, the rule, what is missing). Every append holds whole Steps, so a stored
        history never ends there: one that does was cut (by hand, a restore)."""
        expect = self._expect
        if expect is None:
            return None
        rule, missing = _UNFINISHED[expect[0]]
        return self.version + 1, rule, f"the stream ends after step {expect[2]} of {expect[1]} without {missing}"

    def _check_expectation(self, pos: int, event: TreeEvent, expect: tuple[str, ProcessID, int, int]) -> None:
        kind, pid, step, index = expect
        ok = False
        rule = "step.sequence"
        if kind == "declare":
            ok = (
                isinstance(event, EffectDeclared)
                and event.process_id == pid
                and event.step == step
                and event.index == index
            )
            detail = f"expected EffectDeclared #{index} of step {step} of {pid}"
            rule = "effect.declaration"  # a Step's declarations follow it, complete and in order
        elif kind == "checkpoint":
            ok = isinstance(event, CheckpointCommitted) and event.process_id == pid and event.step == step
            detail = f"expected CheckpointCommitted for step {step} of {pid}"
            rule = "checkpoint.pairing"
        else:  # terminate
            ok = isinstance(event, ProcessTerminated) and event.process_id == pid
            detail = f"expected ProcessTerminated of {pid} after its terminal step"
        if not ok:
            raise self.fail(pos, rule, f"{detail}, got {type(event).__name__} of {event.process_id}")

    def _process(self, pos: int, pid: ProcessID) -> ProcessState:
        process = self.processes.get(pid)
        if process is None:
            raise self.fail(pos, "process.unknown", f"process {pid} does not exist in this tree")
        return process

    # TreeStarted ------------------------------------------------------------

    def _on_tree_started(self, pos: int, e: TreeStarted, _: Any) -> None:
        if pos != 1 or self.version != 0:
            raise self.fail(pos, "stream.first_event", "TreeStarted may appear only at position 1")
        if e.tree_id != TreeID.for_start(e.start_id):
            raise self.fail(pos, "tree.identity", f"tree id {e.tree_id} is not derived from start id {e.start_id}")
        self.tree_id = e.tree_id
        self.start_id = e.start_id
        self.root_id = e.process_id
        self.incarnation = e.incarnation_id
        self.incarnations.append(e.incarnation_id)
        self.limits = e.limits
        self.configuration = e.configuration
        self.bound = {ref.digest: ref for ref in (e.program, *e.programs)}
        process = ProcessState(
            process_id=e.process_id,
            root_id=e.process_id,
            parent_id=None,
            child_key=None,
            depth=0,
            program=e.program,
            input=e.input,
            budget=e.budget,
            capabilities=tuple(e.capabilities),
            limits_max_pending=e.limits.max_pending_signals,
        )
        self._init_state(pos, process)
        self.processes[e.process_id] = process
        self.live[e.process_id] = process

    def _init_state(self, pos: int, process: ProcessState, next_state: Any = _MISSING) -> None:
        """The Process's initial state; ``next_state``: the one the kernel computed from the same
        input with the same Program, which it checked against the Program's input schema."""
        if self.programs is None:
            return
        if next_state is not _MISSING:
            process.state = next_state
            process.has_state = True
            return
        program = self.programs(process.program)
        if program is None:
            raise self.fail(pos, "program.unavailable", f"no program bound for {process.program}")
        # The kernel starts a Process only with an input its Program's schema accepts (its
        # contract, part of the Program's identity: the same ref, the same schema).
        problems = recorded_schema_errors(process.input, program.descriptor.input_schema)
        if problems:
            raise self.fail(pos, "program.input", f"the input does not satisfy {process.program.name}'s input schema: "
                            + "; ".join(problems[:3]))
        try:
            # A copy, as the kernel gives it (normalize): an ``initial`` that changes its input in
            # place changes neither the Process's recorded input nor a later sibling's rebuilt
            # from it (``input_patch``).
            process.state = program.strategy.initial(orjson.loads(canonical_bytes(process.input)))
        except Exception as exc:
            raise self.fail(pos, "program.initial", f"{type(exc).__name__}: {recorded_text(exc)}") from exc
        process.has_state = True

    # WriterActivated --------------------------------------------------------

    def _on_writer_activated(self, pos: int, e: WriterActivated, _: Any) -> None:
        if e.process_id != self.root_id:
            raise self.fail(pos, "writer.root", "WriterActivated must name the root process")
        # A WriterActivated after every Process ended is accepted: no runtime of this release appends
        # one (``Runtime._activate`` looks at the fold under the lease), but a release before
        # 2026-12-05 did when the tree's index row was behind its history (edited, restored), and
        # refusing it would make that finished run unreadable. It changes nothing but the writer.
        if e.previous_incarnation_id != self.incarnation:
            raise self.fail(
                pos,
                "writer.previous_incarnation",
                f"activation claims previous incarnation {e.previous_incarnation_id}, current is {self.incarnation}",
            )
        if e.incarnation_id in self.incarnations:
            raise self.fail(pos, "writer.new_incarnation", f"incarnation {e.incarnation_id} was already active")
        self.incarnation = e.incarnation_id
        self.incarnations.append(e.incarnation_id)

    # ProcessStarted ---------------------------------------------------------

    def _on_process_started(self, pos: int, e: ProcessStarted, next_state: Any) -> None:
        parent = self._process(pos, e.parent_id)
        record = parent.frontier()
        if record is None or record.effect_id != e.start_effect_id or record.operation != Operation.START_CHILD:
            raise self.fail(
                pos, "child.start_effect", f"{e.start_effect_id} is not the frontier start-child effect of {e.parent_id}"
            )
        if record.phase != "planned":
            raise self.fail(pos, "child.start_effect", f"start-child effect {record.effect_id} was already settled")
        if parent.terminal or parent.terminal_intent is not None:
            raise self.fail(pos, "child.parent_state", f"parent {parent.process_id} is terminal or terminating")
        if parent.status != "running":
            # The kernel settles a framework Effect only for a running Process (a paused one's
            # start waits for its resume).
            raise self.fail(pos, "child.parent_state", f"parent {parent.process_id} is {parent.status}")
        if e.process_id != child_process_id(e.start_effect_id):
            raise self.fail(pos, "child.identity", f"child id {e.process_id} is not derived from its start effect")
        if e.process_id in self.processes:
            raise self.fail(pos, "child.identity", f"process {e.process_id} already exists")
        payload = record.payload
        try:
            key = ChildKey(payload.get("key"))
            program = program_ref_of(payload.get("program"), self.bound)
            budget = Budget.from_json(payload.get("budget"))
            capabilities = tuple(sorted(payload.get("capabilities", [])))
        except Exception as exc:
            raise self.fail(pos, "child.spec", f"the start-child effect's spec is invalid: {exc}") from exc
        if key in parent.child_keys:
            raise self.fail(pos, "child.key", f"child key {key} is already used by this parent")
        if not set(capabilities) <= set(parent.capabilities):
            raise self.fail(pos, "child.capabilities", "child capabilities exceed the parent's")
        debit = child_debit(parent.budget, budget)
        if isinstance(debit, str):
            raise self.fail(pos, "budget.child_allocation", debit)
        allocated = parent.allocated.plus(debit)
        for name, used in (
            ("steps", parent.committed_steps + 1),
            ("effects", parent.prepared_effects),
            ("signals", parent.accepted_signals + parent.reserved_signals),
        ):
            quota = getattr(parent.budget, name)
            if not quota.allows(used + getattr(allocated, name), 0):
                raise self.fail(pos, "budget.child_allocation", f"child grant exceeds the parent's {name} budget")
        limits = self.limits
        # The kernel's limits at a child start (kernel.py _start_child), every one of them.
        if parent.depth + 1 > limits.max_depth:
            raise self.fail(pos, "child.tree_limit", "tree depth limit exceeded")
        if limits.max_children is not None and len(parent.children) >= limits.max_children:
            raise self.fail(pos, "child.tree_limit", f"the parent already started max_children ({limits.max_children})")
        if parent.live_children >= limits.max_active_children:
            raise self.fail(pos, "child.tree_limit",
                            f"the parent already has max_active_children ({limits.max_active_children}) live children")
        if limits.max_tree_processes is not None and len(self.processes) >= limits.max_tree_processes:
            raise self.fail(pos, "child.tree_limit",
                            f"the tree already holds max_tree_processes ({limits.max_tree_processes}) processes")
        if self.programs is not None:
            parent_program = self.programs(parent.program)
            if parent_program is not None and parent_program.child(program) is None:
                # The kernel fails such a start (engine.child.deployment_unavailable).
                raise self.fail(pos, "child.program", f"program {program.name} is not bound to {parent.program.name}")
        parent.allocated = allocated
        child = ProcessState(
            process_id=e.process_id,
            root_id=parent.root_id,
            parent_id=parent.process_id,
            child_key=key,
            depth=parent.depth + 1,
            program=program,
            input=payload.get("input"),
            budget=budget,
            capabilities=capabilities,
            limits_max_pending=parent.limits_max_pending,
            start_effect_id=e.start_effect_id,
            input_patch=record.input_patch,
        )
        self._init_state(pos, child, next_state)
        child.ordinal = len(self.processes)
        self.processes[e.process_id] = child
        self.live[e.process_id] = child
        parent.children.append(e.process_id)
        parent.child_keys[key] = e.process_id
        parent.live_children += 1
        parent.undrained_children += 1
        # The start is settled by the child's existence: ChildStartResult, derived.
        record.phase = "settled"
        record.status = SettlementStatus.SUCCEEDED
        record.result = {"key": key, "program": payload.get("program"), "process_id": e.process_id}
        self._settle_implicit(parent)

    # SignalAdmitted ---------------------------------------------------------

    def _on_signal_admitted(self, pos: int, e: SignalAdmitted, _: Any) -> None:
        from agentfold.domain.mailbox import check_admission

        process = self._process(pos, e.process_id)
        if e.signal_id in process.signal_index:
            raise self.fail(pos, "signal.dedup", f"signal {e.signal_id} was already admitted to {e.process_id}")
        if e.source == "parent":
            self._check_parent_command(pos, process, Operation.SIGNAL_CHILD, "signal.source", e)
        try:
            request = SignalRequest(e.signal_id, e.payload, e.wait_id)
            schema: object = None
            check_schema = False
            if self.programs is not None and e.source == "host":
                program = self.programs(process.program)
                if program is not None:
                    schema = program.descriptor.signal_schema
                    check_schema = True
            check_admission(process, [request], source=e.source, signal_schema=schema, check_signal_schema=check_schema,
                            recorded=True)
        except Exception as exc:
            code = getattr(exc, "code", type(exc).__name__)
            over_budget = not process.budget.signals.allows(
                process.accepted_signals + process.allocated.signals + process.reserved_signals, 1
            )
            rule = "budget.signals" if code == "engine.limit.signals" and over_budget else "signal.admission"
            raise self.fail(pos, rule, f"{code}: {exc}") from exc
        self._append_signal(process, e.signal_id, e.wait_id, e.payload, e.source)
        process.accepted_signals += 1

    def _append_signal(
        self,
        process: ProcessState,
        sid: SignalID,
        wid: WaitID | None,
        payload: JSON,
        source: str,
        status: SettlementStatus | None = None,
        eid: EffectID | None = None,
        answers: bool = True,
    ) -> None:
        process.arrivals += 1
        record = MailboxRecord(process.arrivals, sid, wid, payload, source, status, eid)
        process.mailbox.append(record)
        process.signal_index[sid] = record
        if wid is not None and answers:
            wait = process.waits.get(wid)
            if wait is not None and wait.answered_by is None:
                wait.answered_by = record.arrival
                if process.current_wait == wid:
                    process.current_wait = None
                    if process.status == "waiting":
                        process.status = "running"

    # StepCommitted ----------------------------------------------------------

    def _on_step_committed(self, pos: int, e: StepCommitted, next_state: Any) -> None:
        process = self._process(pos, e.process_id)
        if process.terminal:
            raise self.fail(pos, "step.process_terminal", f"process {e.process_id} is {process.status}")
        if process.status != "running":
            raise self.fail(pos, "step.not_runnable", f"process {e.process_id} is {process.status}")
        if process.batch:
            raise self.fail(pos, "step.batch_outstanding", f"process {e.process_id} has unsettled effects")
        if process.terminal_intent is not None:
            raise self.fail(pos, "step.terminal_intent", f"process {e.process_id} has a pending {process.terminal_intent}")
        if e.step != process.committed_steps + 1:
            raise self.fail(pos, "step.sequence", f"expected step {process.committed_steps + 1}, got {e.step}")
        if not 0 <= e.consumed <= process.pending_count:
            raise self.fail(pos, "step.consumed", f"consumed {e.consumed} of {process.pending_count} pending signals")
        if not process.budget.steps.allows(process.committed_steps + process.allocated.steps, 1):
            raise self.fail(pos, "budget.steps", f"step {e.step} exceeds the steps budget of {e.process_id}")
        if e.effects and e.kind != "continue":
            raise self.fail(pos, "step.effects", "only a continue transition may declare effects")
        if e.kind == "pause" and not (e.reason or "").strip():
            # The kernel's Step check (check_reason) refuses a blank reason.
            raise self.fail(pos, "step.transition", f"a pause transition needs a reason, not {e.reason!r}")
        # Consume the window prefix.
        start = process.cursor
        consumed_records = process.mailbox[start : start + e.consumed]
        consumed = [r.signal() for r in consumed_records]
        process.window_cache = process.window_cache[e.consumed :]
        freed: list[WaitKey] = []
        for record in consumed_records:
            if record.source != "engine":
                # Fix the digest before the payload is released: a host resending this signal
                # id is deduplicated by it. Engine signals are never resent (reserved ids).
                record.digest  # noqa: B018
            record.consumed = True
            record.payload = None
            if record.wait_id is not None:
                wait = process.waits.get(record.wait_id)
                if wait is not None and wait.answered_by == record.arrival:
                    wait.closed = True
                    if process.open_wait_keys.get(wait.key) == wait.wait_id:
                        del process.open_wait_keys[wait.key]
                        freed.append(wait.key)
                    if wait.kind == "children":
                        # Engine-internal and answered: nothing will address it again.
                        del process.waits[wait.wait_id]
        if freed:
            process.freed_wait_keys = (e.step, frozenset(freed))
        if consumed_records:
            process.consumed_through = consumed_records[-1].arrival
            kept = [r for r in consumed_records if r.source != "engine"]
            if len(kept) != len(consumed_records):
                process.mailbox[start : start + e.consumed] = kept
                for record in consumed_records:
                    if record.source == "engine":
                        process.signal_index.pop(record.signal_id, None)
            process.cursor = start + len(kept)
        if process.has_state:
            if next_state is not _MISSING:
                process.state = next_state
            else:
                assert self.programs is not None
                program = self.programs(process.program)
                assert program is not None
                try:
                    process.state = program.strategy.evolve(process.state, e.facts, consumed)
                except Exception as exc:
                    raise self.fail(pos, "step.evolve", f"{type(exc).__name__}: {recorded_text(exc)}") from exc
        process.committed_steps = e.step
        process.last_kind = e.kind
        if e.kind == "wait":
            wait = process.waits.get(e.wait_id) if e.wait_id is not None else None
            if wait is None or wait.closed:
                raise self.fail(pos, "step.wait", f"wait {e.wait_id} is not an open wait of {e.process_id}")
            if wait.answered_by is None:
                process.status = "waiting"
                process.current_wait = wait.wait_id
        elif e.kind == "pause":
            process.status = "paused"
            process.pause_reason = e.reason
        if e.kind == "continue" and e.effects:
            process.batch_step = e.step
            self._expect = ("declare", e.process_id, e.step, 0)
            self._pending_declarations = e.effects
        elif e.kind == "checkpoint":
            self._expect = ("checkpoint", e.process_id, e.step, 0)
        elif e.kind in ("complete", "fail"):
            self._expect = ("terminate", e.process_id, e.step, 0)
            self._completing = {
                c.effect_id: c.payload
                for c in consumed
                if c.effect_id is not None and c.status is SettlementStatus.SUCCEEDED
            } if e.kind == "complete" else {}
        else:
            self._expect = None

    # EffectDeclared ---------------------------------------------------------

    def _on_effect_declared(self, pos: int, e: EffectDeclared, _: Any) -> None:
        if self._expect is None or self._expect[0] != "declare":
            raise self.fail(pos, "effect.declaration", "EffectDeclared must follow its continue step")
        process = self._process(pos, e.process_id)
        if e.effect_id != derive_effect_id(e.process_id, e.step, e.index):
            raise self.fail(pos, "effect.identity", f"effect id {e.effect_id} is not derived from its step and index")
        payload = e.payload
        patch: JSON = None
        if holds_input_patch(e.target, payload):
            patch = payload[INPUT_PATCH]
            payload = self._input_from_changes(pos, process, payload)
        if not process.budget.effects.allows(process.prepared_effects + process.allocated.effects, 1):
            raise self.fail(pos, "budget.effects", f"effect {e.effect_id} exceeds the effects budget")
        reserve = 2 if e.target == "framework" and isinstance(payload, dict) and payload.get(
            "operation"
        ) == Operation.WAIT_CHILDREN else 1
        if not process.budget.signals.allows(
            process.accepted_signals + process.allocated.signals + process.reserved_signals, reserve
        ):
            raise self.fail(pos, "budget.signals", f"effect {e.effect_id} cannot reserve its settlement signal")
        if e.target == "framework":
            op = payload.get("operation") if isinstance(payload, dict) else None
            if op not in _OPERATIONS:
                raise self.fail(pos, "effect.framework", f"unknown framework operation {op!r}")
            if e.replay != "never" or e.capabilities:
                # The kernel declares every framework Effect `never`, requiring nothing.
                raise self.fail(pos, "effect.framework", f"a framework effect is declared with replay never and no "
                                f"capabilities, not {e.replay!r} and {list(e.capabilities)}")
            try:
                if op in (Operation.WAIT, Operation.WAIT_CHILDREN):
                    key = WaitKey(payload["key"])
                    freed_step, freed = process.freed_wait_keys
                    if key in process.open_wait_keys or (freed_step == e.step and key in freed) or any(
                        r.step == e.step and r.operation in (Operation.WAIT, Operation.WAIT_CHILDREN)
                        and isinstance(r.payload, dict) and r.payload.get("key") == key for r in process.batch
                    ):  # open, open until this Step consumed its answer, or opened by an earlier
                        # Effect of the same Step (the kernel refuses all three)
                        raise ValueError(f"wait key {key} is already open")
                if op == Operation.WAIT_CHILDREN:
                    spec = ChildWaitSpec.from_json(payload)
                    for cid in spec.children:
                        child = self.processes.get(cid)
                        if child is None or child.parent_id != process.process_id:
                            raise ValueError(f"{cid} is not a direct child of {process.process_id}")
                elif op != Operation.WAIT:
                    # The shapes the kernel's Step check admits, which settling them relies on: a
                    # history holding another (a forged import) is refused here, not met by every
                    # recovery of the store as a KeyError.
                    check_child_operation(Operation(op), payload, self.bound, reason=_text)
            except Exception as exc:
                raise self.fail(pos, "effect.framework", f"invalid {op} effect: {exc}") from exc
        elif e.capabilities and not set(e.capabilities) <= set(process.capabilities):
            # The kernel refuses such a Step (engine.capability.denied): a history holding one
            # would have the call made with capabilities its Process never held.
            raise self.fail(pos, "effect.capabilities", f"effect {e.effect_id} requires capabilities "
                            f"{sorted(set(e.capabilities) - set(process.capabilities))} its process does not hold")
        record = EffectRecord(e.effect_id, e.step, e.index, e.target, payload, e.replay, tuple(e.capabilities),
                              input_patch=patch)
        process.batch.append(record)
        process.batch_index[e.effect_id] = record
        process.prepared_effects += 1
        process.reserved_signals += reserve
        remaining = self._pending_declarations - 1
        self._pending_declarations = remaining
        self._expect = ("declare", e.process_id, e.step, e.index + 1) if remaining else None
        if not remaining:
            self._settle_implicit(process)

    def _input_from_changes(self, pos: int, process: ProcessState, payload: dict[str, Any]) -> dict[str, Any]:
        """A start-child payload with its input rebuilt from ``input_patch`` (the changes from an
        earlier child's input: agentfold.domain.input_changes)."""
        patch = payload[INPUT_PATCH]
        if not isinstance(patch, dict) or set(patch) != {"base", "ops"} or not isinstance(patch["base"], str):
            raise self.fail(pos, "effect.input_patch", f"{INPUT_PATCH} is an object with exactly base (a child key) and ops")
        base = process.child_keys.get(patch["base"])  # type: ignore[call-overload]
        if base is None:
            raise self.fail(pos, "effect.input_patch",
                            f"its base {patch['base']!r} is not a child {process.process_id} started before")
        try:
            return with_whole_input(payload, self.processes[base].input)
        except ValueError as exc:
            raise self.fail(pos, "effect.input_patch", f"its changes do not apply to {patch['base']}'s input: {exc}") from exc

    # EffectDispatched -------------------------------------------------------

    def _on_effect_dispatched(self, pos: int, e: EffectDispatched, _: Any) -> None:
        process = self._process(pos, e.process_id)
        record = process.effect(e.effect_id)
        if record is None:
            if e.effect_id in self._finished_effects:
                raise self.fail(pos, "dispatch.after_settlement", f"effect {e.effect_id} is already settled")
            raise self.fail(pos, "effect.declared", f"effect {e.effect_id} is not declared in the current batch")
        if record.target != "dispatcher":
            raise self.fail(pos, "dispatch.target", f"effect {e.effect_id} is a framework effect")
        # Before the frontier check: a definitely settled effect is behind the frontier.
        if record.phase == "settled":
            raise self.fail(pos, "dispatch.after_settlement", f"effect {e.effect_id} is already settled")
        if process.frontier() is not record:
            raise self.fail(pos, "effect.frontier", f"effect {e.effect_id} is not the frontier of its batch")
        if record.phase == "pending":
            if record.incarnation_id == self.incarnation:
                raise self.fail(pos, "dispatch.once", f"effect {e.effect_id} was already dispatched by this writer")
            if record.replay != "same_identity":
                raise self.fail(pos, "dispatch.replay_policy", f"effect {e.effect_id} may not be dispatched again")
        if e.incarnation_id != self.incarnation:
            raise self.fail(pos, "dispatch.incarnation", f"dispatch by {e.incarnation_id}, owner is {self.incarnation}")
        # A paused Process starts no call; a new owner dispatching again a call already in flight
        # (pending, same_identity) starts none: a pause does not stop a call in flight.
        replaying = record.phase == "pending"
        if process.terminal or process.terminal_intent is not None or (process.status == "paused" and not replaying):
            raise self.fail(pos, "dispatch.process_state", f"process {e.process_id} may not dispatch now")
        record.phase = "pending"
        record.attempt_id = e.attempt_id
        record.incarnation_id = self.incarnation
        record.attempts += 1

    # EffectSettled ----------------------------------------------------------

    def _on_effect_settled(self, pos: int, e: EffectSettled, _: Any) -> None:
        process = self._process(pos, e.process_id)
        record = process.effect(e.effect_id)
        if record is None:
            rule = "settlement.once" if e.effect_id in self._finished_effects else "settlement.declared"
            raise self.fail(pos, rule, f"effect {e.effect_id} is not an unsettled effect of {e.process_id}")
        if record.phase == "settled":
            raise self.fail(pos, "settlement.once", f"effect {e.effect_id} is already settled")
        if process.frontier() is not record:
            raise self.fail(pos, "effect.frontier", f"effect {e.effect_id} is not the frontier of its batch")
        # Safe: the member SettlementStatus(e.status) returns, by a dict look-up of a plain text;
        # anything else (an unknown or forged value) still goes through (and raises in) the Enum call.
        status = _SETTLEMENT_STATUS.get(e.status) if type(e.status) is str else None
        if status is None:
            status = SettlementStatus(e.status)
        if record.target == "dispatcher":
            if record.phase != "pending":
                raise self.fail(pos, "settlement.after_dispatch", f"effect {e.effect_id} was never dispatched")
            if status.definite:
                if record.incarnation_id != self.incarnation or e.attempt_id != record.attempt_id:
                    raise self.fail(
                        pos, "settlement.attempt", f"a definite settlement must come from the current attempt of {e.effect_id}"
                    )
            elif e.diagnostic is None:
                raise self.fail(pos, "settlement.diagnostic", "an unknown settlement needs a diagnostic")
            elif e.attempt_id != record.attempt_id:
                # The kernel records unknown only the attempt in flight (its dispatcher's outcome,
                # or recovery's decision about it), never another one.
                raise self.fail(
                    pos, "settlement.attempt",
                    f"an unknown settlement names attempt {e.attempt_id}, the attempt in flight is {record.attempt_id}",
                )
        else:
            if not status.definite:
                raise self.fail(pos, "settlement.framework", "a framework effect always settles definitely")
            if process.terminal:
                raise self.fail(pos, "settlement.process_terminal", f"process {e.process_id} is terminal")
            self._check_framework_settlement(pos, process, record, e)
            if process.status != "running" or process.terminal_intent is not None:
                # The kernel carries out a framework Effect only for a running Process without a
                # terminal intent: a paused one's waits for its resume, a terminating one's never.
                state = f"{process.terminal_intent} requested" if process.terminal_intent else process.status
                raise self.fail(pos, "settlement.process_state", f"process {e.process_id} is {state}")
        if status.definite and process.terminal:
            raise self.fail(pos, "settlement.process_terminal", f"process {e.process_id} is terminal")
        record.phase = "settled"
        record.status = status
        record.result = e.payload
        record.diagnostic = e.diagnostic
        if status is SettlementStatus.UNKNOWN:
            self.unknown_ids.add(e.effect_id)
        self._settle_implicit(process)

    def _check_framework_settlement(self, pos: int, process: ProcessState, record: EffectRecord, e: EffectSettled) -> None:
        op = record.operation
        payload = e.payload if isinstance(e.payload, dict) else {}
        if op == Operation.START_CHILD:
            if e.status == "succeeded":
                raise self.fail(
                    pos, "child.start_settlement", "a successful start is recorded by ProcessStarted, not EffectSettled"
                )
            if "failure" not in payload:
                raise self.fail(pos, "child.start_settlement", "a failed start carries a failure and starts no child")
        elif op in (Operation.WAIT, Operation.WAIT_CHILDREN):
            raise self.fail(pos, "wait.settlement", "a wait settles by itself when it reaches the frontier")
        elif op in (Operation.SIGNAL_CHILD, Operation.CANCEL_CHILD) and (
            payload.get("child") != record.payload.get("child") or (e.status == "failed") != ("failure" in payload)
        ):
            raise self.fail(pos, "child.control_settlement", "a child control receipt must match its effect")

    def _settle_implicit(self, process: ProcessState) -> None:
        """Settle waits at the frontier (they need no outside work), then finish the batch if done.

        A ``wait`` or ``wait_children`` Effect settles the moment it reaches the frontier
        of a running Process without a terminal intent; nothing is stored for it.
        """
        if process.status == "running" and process.terminal_intent is None:
            # Everything before the frontier is definite, so start there (not at 0).
            while (record := process.frontier()) is not None:
                if record.phase == "planned" and record.operation in (Operation.WAIT, Operation.WAIT_CHILDREN):
                    record.phase = "settled"
                    record.status = SettlementStatus.SUCCEEDED
                    record.result = {"wait_id": wait_id_for(record.effect_id)}
                    continue
                break
        self._maybe_finish_batch(process)

    def _maybe_finish_batch(self, process: ProcessState) -> None:
        if not process.batch or process.frontier() is not None:
            return
        batch = process.batch
        process.batch = []
        process.batch_index.clear()
        process.frontier_at = 0
        for record in batch:
            self._finished_effects.add(record.effect_id)
            self._deliver(process, record)

    def _deliver(self, process: ProcessState, record: EffectRecord) -> None:
        op = record.operation
        process.reserved_signals -= 1
        process.accepted_signals += 1
        if op in (Operation.WAIT, Operation.WAIT_CHILDREN):
            wid = wait_id_for(record.effect_id)
            key = WaitKey(record.payload["key"])
            if op == Operation.WAIT:
                wait = WaitRecord(
                    wid, key, "external", record.effect_id,
                    prompt=record.payload.get("prompt"), response_schema=record.payload.get("response_schema"),
                )
            else:
                wait = WaitRecord(wid, key, "children", record.effect_id, spec=ChildWaitSpec.from_json(record.payload))
            process.waits[wid] = wait
            process.open_wait_keys[key] = wid
            if op == Operation.WAIT_CHILDREN:
                process.child_waits[wid] = wait
            self._append_signal(
                process, wait_opened_signal_id(wid), wid, {"operation": op, "wait_id": wid, "key": key}, "engine",
                answers=False,
            )
            if op == Operation.WAIT_CHILDREN:
                self._check_child_wait(process, wait)
            return
        status = record.status if record.target == "dispatcher" else None
        self._append_signal(
            process, settlement_signal_id(record.effect_id), None, record.result, "engine", status, record.effect_id
        )

    def _at_boundary(self, child: ProcessState, boundary: Boundary) -> bool:
        return child.terminal if boundary is Boundary.TERMINAL_RESULT else child.drained

    def _check_child_wait(self, process: ProcessState, wait: WaitRecord, moved: ProcessState | None = None) -> None:
        """Satisfy ``wait`` if enough of its children are at its boundary. ``moved``: the
        only child that may have reached the boundary since the last check (see
        WaitRecord.reached); None rescans every child (a new wait, or a state from_json)."""
        if wait.satisfied or wait.closed or process.terminal:
            return
        spec = wait.spec
        assert spec is not None
        if wait.members is None or moved is None:
            wait.members = frozenset(spec.children)
            wait.reached = set()
            for cid in spec.children:
                child = self.processes.get(cid)
                if child is not None and self._at_boundary(child, spec.boundary):
                    wait.reached.add(cid)
        elif moved.process_id in wait.members and moved.process_id not in wait.reached:
            if self._at_boundary(moved, spec.boundary):
                wait.reached.add(moved.process_id)
        if len(wait.reached) < spec.required:
            return
        at_boundary = [self.processes[cid] for cid in spec.children if cid in wait.reached]
        wait.satisfied = True
        wait.members = None
        wait.reached = set()
        outcomes = [self.outcome(child, spec.boundary) for child in at_boundary]
        process.reserved_signals -= 1
        process.accepted_signals += 1
        self._append_signal(
            process,
            child_wait_satisfied_signal_id(wait.wait_id),
            wait.wait_id,
            {"operation": "child_wait_satisfied", "wait_id": wait.wait_id, "key": wait.key,
             "boundary": spec.boundary.value, "outcomes": outcomes},
            "engine",
        )

    def outcome(self, child: ProcessState, boundary: Boundary) -> dict[str, JSON]:
        """A ChildOutcome: the child's result at the boundary (kernel spec 6.3)."""
        result = self.result_json(child)
        body: dict[str, JSON] = {
            "boundary": boundary.value,
            "key": child.child_key,
            "process_id": child.process_id,
            "result": result,
        }
        if boundary is Boundary.SUBTREE_DRAINED:
            body["subtree_unresolved_effects"] = self.subtree_unresolved(child.process_id)
        return body

    def result_json(self, process: ProcessState) -> dict[str, JSON]:
        term = process.termination
        body: dict[str, JSON] = {
            "process_id": process.process_id,
            "status": process.status,
            "usage": process.usage,
        }
        if term is not None:
            body["termination"] = term.to_json()
        if process.status == "completed":
            body["output"] = process.output
        return body

    # EffectResolved ---------------------------------------------------------

    def _on_effect_resolved(self, pos: int, e: EffectResolved, _: Any) -> None:
        process = self._process(pos, e.process_id)
        record = process.effect(e.effect_id)
        # Checked first: a resolved effect is definite (or gone with its batch), not unknown.
        if e.effect_id in self._resolved_effects or (record is not None and record.resolved_by is not None):
            raise self.fail(pos, "resolution.once", f"effect {e.effect_id} was already resolved")
        if record is None or not record.unknown:
            raise self.fail(pos, "resolution.only_unknown", f"effect {e.effect_id} is not an unknown effect")
        if process.terminal or process.terminal_intent is not None:
            raise self.fail(pos, "resolution.process_finished", f"process {e.process_id} is finished or finishing")
        if e.resolved_by == "replay" and record.replay != "same_identity":
            raise self.fail(pos, "dispatch.replay_policy", f"effect {e.effect_id} may not be replayed")
        record.status = SettlementStatus(e.status)
        record.result = e.payload
        record.resolved_by = e.resolved_by
        self._resolved_effects.add(e.effect_id)
        self.unknown_ids.discard(e.effect_id)
        self._settle_implicit(process)

    # CheckpointCommitted ----------------------------------------------------

    def _on_checkpoint(self, pos: int, e: CheckpointCommitted, _: Any) -> None:
        if self._expect != ("checkpoint", e.process_id, e.step, 0):
            raise self.fail(pos, "checkpoint.pairing", "CheckpointCommitted must follow its checkpoint step")
        if not valid_qualified_name(e.kind):
            # The kernel's Step check refuses such a kind (engine.transition.invalid).
            raise self.fail(pos, "checkpoint.kind", f"checkpoint kind {e.kind[:80]!r} is not a qualified name")
        self._expect = None

    # ControlRequested -------------------------------------------------------

    def _on_control(self, pos: int, e: ControlRequested, _: Any) -> None:
        process = self._process(pos, e.process_id)
        if process.terminal:
            raise self.fail(pos, "control.process_terminal", f"process {e.process_id} is {process.status}")
        if e.owner == "parent":
            parent = self.processes.get(process.parent_id) if process.parent_id is not None else None
            if parent is not None and not parent.terminal and parent.terminal_intent is not None:
                # A parent that has to end but cannot yet (a call in flight) stops its subtree
                # at once: each live child records the intent the parent's end will give it.
                expected = stop_intent(parent.terminal_intent)
                if e.control != expected:
                    raise self.fail(
                        pos, "control.owner",
                        f"parent {parent.process_id} is ending ({parent.terminal_intent} requested): "
                        f"its children record {expected}, not {e.control}",
                    )
            else:
                if e.control != "cancel":
                    raise self.fail(pos, "control.owner", f"a parent only cancels its children, not {e.control}")
                self._check_parent_command(pos, process, Operation.CANCEL_CHILD, "control.owner")
        if e.control != "resume" and not e.reason.strip():
            # Every reason the kernel records is checked non-blank (check_reason), a parent's too:
            # the end it gives its children, its cancel_child's reason (effect.framework).
            raise self.fail(pos, "control.reason", f"a {e.control} needs a reason, not {e.reason!r}")
        if e.control == "pause":
            if process.status not in ("running", "waiting") or process.terminal_intent is not None:
                raise self.fail(pos, "control.pause_state", f"cannot pause a {process.status} process")
            process.status = "paused"
            process.pause_reason = e.reason
        elif e.control == "resume":
            if process.status != "paused":
                raise self.fail(pos, "control.resume_state", f"cannot resume a {process.status} process")
            process.pause_reason = None
            process.status = "waiting" if process.current_wait is not None else "running"
            self._settle_implicit(process)
        else:
            if e.control in process.intents:
                raise self.fail(pos, "control.duplicate_intent", f"{e.control} was already requested")
            process.intents[e.control] = (e.owner, e.reason)

    # ProcessTerminated ------------------------------------------------------

    def _output_of(self, pos: int, e: ProcessTerminated, after_step: bool) -> JSON:
        """The output an ``output_of`` reference names: a value of a succeeded settlement
        that the complete Step right before consumed."""
        ref = e.output_of
        assert ref is not None
        if e.status != "completed" or e.output is not None:
            raise self.fail(pos, "terminal.output_of", "only a completion without an inline output refers to one")
        settled = self._completing if after_step and self._expect is not None and self._expect[1] == e.process_id else {}
        if ref.effect_id not in settled:
            raise self.fail(
                pos, "terminal.output_of",
                f"effect {ref.effect_id} is not a succeeded settlement the completing step of {e.process_id} consumed",
            )
        found, value = value_at(settled[ref.effect_id], ref.path)
        if not found:
            raise self.fail(pos, "terminal.output_of", f"the result of {ref.effect_id} has no value at {list(ref.path)}")
        return value

    def _on_terminated(self, pos: int, e: ProcessTerminated, _: Any) -> None:
        process = self._process(pos, e.process_id)
        if process.terminal:
            raise self.fail(pos, "terminal.once", f"process {e.process_id} already ended {process.status}")
        if process.in_flight():
            raise self.fail(pos, "terminal.in_flight", f"process {e.process_id} has dispatched, unsettled effects")
        if CAUSE_STATUS.get(e.cause) != e.status:
            raise self.fail(pos, "terminal.cause", f"cause {e.cause} does not give status {e.status}")
        after_step = self._expect is not None and self._expect[0] == "terminate"
        intent = process.terminal_intent
        if intent is not None:
            owner, _reason = process.intents[intent]
            expected = intent_cause(intent, owner)
            if e.cause != expected:
                raise self.fail(pos, "terminal.priority", f"pending {intent} requires cause {expected}, got {e.cause}")
        elif e.cause == "completion":
            if not (after_step and process.last_kind == "complete"):
                raise self.fail(pos, "terminal.priority", "completion must follow a complete step")
        else:
            if e.cause not in FAILURE_CAUSE.values():
                raise self.fail(pos, "terminal.priority", f"cause {e.cause} without a matching intent")
            if e.failure is None or FAILURE_CAUSE[e.failure.kind] != e.cause:
                raise self.fail(pos, "terminal.failure", "a failure cause needs a failure of the matching kind")
            if after_step and process.last_kind != "fail":
                raise self.fail(pos, "terminal.priority", "a complete step must end completed")
            if process.status != "running" or process.batch:
                # A failure without an intent is a Step's (refused, or a fail Step), and the kernel
                # runs a Step only for a running Process with no batch outstanding: one with a
                # planned or unknown Effect at its frontier, waiting or paused, is not failed.
                state = "a batch outstanding" if process.batch else process.status
                raise self.fail(pos, "terminal.failure_state",
                                f"process {e.process_id} ends {e.status} without an intent while {state}")
        output = e.output
        if e.output_of is not None:
            output = self._output_of(pos, e, after_step)
        if e.status == "completed":
            if self.programs is not None and process.has_state:
                program = self.programs(process.program)
                if program is not None:
                    if recorded_schema_errors(output, program.descriptor.output_schema):
                        raise self.fail(pos, "terminal.output_schema", "output does not satisfy the output schema")
        elif e.output is not None:
            raise self.fail(pos, "terminal.output", "only a completed process has an output")
        unresolved = tuple(sorted(r.effect_id for r in process.unknown_effects()))
        if tuple(e.unresolved_effect_ids) != unresolved:
            raise self.fail(pos, "terminal.unresolved", f"unresolved effects must be {list(unresolved)}")
        self._expect = None
        self._completing = {}
        process.status = e.status
        self.live.pop(process.process_id, None)
        parent = self.processes.get(process.parent_id) if process.parent_id is not None else None
        if parent is not None:
            parent.live_children -= 1
        # The subtrees this end drains: this Process's, then each ancestor's that waited only on it.
        drained = process
        while drained.drained and drained.parent_id is not None:
            drained = self.processes[drained.parent_id]
            drained.undrained_children -= 1
        process.termination = Termination(e.status, e.cause, e.reason, e.failure, unresolved)
        process.output = output if e.status == "completed" else None
        process.current_wait = None
        process.pause_reason = None
        process.reserved_signals = 0
        for wait in process.waits.values():
            wait.closed = True
        process.open_wait_keys.clear()
        process.intents.clear()
        # Planned effects never start; settled records stay as evidence.
        # Propagation: live children get a parent-owned terminal intent.
        kind = "deadline" if e.status == "timed_out" else "cancel"
        for cid in process.children:
            child = self.processes[cid]
            if not child.terminal and kind not in child.intents:
                child.intents[kind] = ("parent", f"parent {process.process_id} ended {e.status}")
        # Ancestors' child waits may be satisfied now.
        self._notify_waiters(process)

    def _check_parent_command(
        self, pos: int, child: ProcessState, op: Operation, rule: str, signal: SignalAdmitted | None = None
    ) -> None:
        """Parent-owned input is recorded only while its parent's frontier signal_child/cancel_child settles."""
        parent = self.processes.get(child.parent_id) if child.parent_id is not None else None
        record = parent.frontier() if parent is not None else None
        payload = record.payload if record is not None and isinstance(record.payload, dict) else {}
        ok = (
            record is not None
            and record.phase == "planned"
            and record.operation == op
            and payload.get("child") == child.process_id
        )
        if ok and signal is not None:
            body = payload.get("signal")
            ok = (
                isinstance(body, dict)
                and body.get("id") == signal.signal_id
                and body.get("wait_id") == signal.wait_id
                and body.get("payload") == signal.payload
            )
        if not ok:
            raise self.fail(pos, rule, f"no frontier {op.value} effect of the parent of {child.process_id} matches")
        assert parent is not None
        if parent.status != "running" or parent.terminal_intent is not None:
            # The kernel carries out a parent's framework Effect only while it runs without a
            # terminal intent (a paused parent's waits for its resume, a terminating one's never).
            state = f"{parent.terminal_intent} requested" if parent.terminal_intent else parent.status
            raise self.fail(pos, rule, f"the parent of {child.process_id} is {state}: its {op.value} is not carried out")

    def _notify_waiters(self, process: ProcessState) -> None:
        """After ``process`` ended: check its ancestors' open child waits, nearest first.

        At each ancestor, only the child on the path to ``process`` can have reached a
        boundary (terminal: ``process`` itself; drained: an ancestor of it), so each wait
        looks at that one child (``_check_child_wait``'s ``moved``)."""
        current: ProcessState | None = process
        while current is not None and current.parent_id is not None:
            parent = self.processes[current.parent_id]
            if parent.child_waits:
                for wait in list(parent.child_waits.values()):
                    if wait.satisfied or wait.closed or wait.wait_id not in parent.waits:
                        del parent.child_waits[wait.wait_id]
                        continue
                    self._check_child_wait(parent, wait, current)
            current = parent

    # -- snapshots ---------------------------------------------------------

    def to_json(self, *, with_state: bool = True, compact: bool = False, shown: bool = False) -> dict[str, JSON]:
        """The whole folded tree as JSON (used for ``show``, capture and storage snapshots).

        ``shown`` (``show``, ``replay``): a Program's ``encode_state`` that raises is reported
        as the process's ``state_error`` instead of raised (a snapshot or a copy must fail).

        ``compact`` (storage snapshots) names each process's program by its text ref (the
        tree's bound refs are written once). A finished process never changes, so its JSON
        is built once and reused; callers must not mutate what this returns.
        """
        processes = []
        for p in self.processes.values():
            cache_key = (with_state, compact, self.programs is not None)
            if p.terminal and p.json_cache is not None and p.json_cache[0] == cache_key:
                processes.append(p.json_cache[1])
                continue
            body: dict[str, JSON] = {
                **p.relation_json(),
                "program": str(p.program) if compact else p.program.to_json(),
                "status": p.status,
                "input": p.input,
                "budget": p.budget.to_json(),
                "allocated": p.allocated.to_json(),
                "usage": p.usage,
                "reserved_signals": p.reserved_signals,
                "capabilities": list(p.capabilities),
                "committed_steps": p.committed_steps,
                "last_kind": p.last_kind,
                "mailbox": {
                    "signals": [r.to_json() for r in p.mailbox],
                    "cursor": p.cursor,
                    "arrivals": p.arrivals,
                    "consumed_through": p.consumed_through,
                },
                "waits": [w.to_json() for w in p.waits.values()],
                "current_wait_id": p.current_wait,
                "pause_reason": p.pause_reason,
                "pending_control": {k: {"owner": o, "reason": r} for k, (o, r) in p.intents.items()},
                "prepared": {"step": p.batch_step, "effects": [r.to_json(compact) for r in p.batch]} if p.batch else None,
                "children": list(p.children),
                "start_effect_id": p.start_effect_id,
                "termination": p.termination.to_json() if p.termination else None,
                "output": p.output,
            }
            if compact and p.input_patch is not None:
                # As its start stored it: the changes from an earlier sibling's input (a team's
                # Turn repeats every earlier task). Whole, a snapshot grew with the square of the
                # turns; ``from_json`` rebuilds the input as the fold does.
                del body["input"]
                body[INPUT_PATCH] = p.input_patch
            if with_state and p.has_state and self.programs is not None:
                program = self.programs(p.program)
                if program is not None:
                    try:
                        body["state"] = program.strategy.encode_state(p.state)
                    except Exception as exc:
                        if not shown:
                            raise
                        body = {**body, "state_error": f"encode_state failed: {type(exc).__name__}: {recorded_text(exc)}"}
            if p.terminal and "state_error" not in body:  # a body with an error is never reused
                p.json_cache = (cache_key, body)
            processes.append(body)
        return {
            "tree_id": self.tree_id,
            "start_id": self.start_id,
            "root_id": self.root_id,
            "incarnation_id": self.incarnation,
            "incarnations": list(self.incarnations),
            "version": self.version,
            "limits": self.limits.model_dump(mode="json"),
            "configuration": self.configuration,
            "programs": [ref.to_json() for ref in self.bound.values()],
            "classification": self.classification() if self.processes else None,
            "processes": processes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], programs: ProgramResolver | None = None) -> TreeState:
        """Rebuild a state captured by :meth:`to_json` (storage snapshots)."""
        tree = cls(programs)
        tree.tree_id = TreeID(data["tree_id"])
        tree.start_id = StartID(data["start_id"])
        tree.root_id = ProcessID(data["root_id"])
        tree.incarnation = TreeIncarnationID(data["incarnation_id"])
        tree.incarnations = [TreeIncarnationID(i) for i in data["incarnations"]]
        tree.version = int(data["version"])
        tree.limits = TreeLimits.model_validate(data["limits"])
        tree.configuration = data.get("configuration")
        tree.bound = {ref.digest: ref for ref in (ProgramRef.from_json(r) for r in data.get("programs", []))}
        started: dict[tuple[str, str], ProcessState] = {}  # (parent id, child key): each child so far
        for body in data["processes"]:
            patch = body.get(INPUT_PATCH)
            p = ProcessState(
                process_id=ProcessID(body["process_id"]),
                root_id=ProcessID(body["root_id"]),
                parent_id=ProcessID(body["parent_id"]) if body["parent_id"] else None,
                child_key=ChildKey(body["child_key"]) if body["child_key"] else None,
                depth=int(body["depth"]),
                program=(
                    program_ref_of(body["program"], tree.bound)
                    if isinstance(body["program"], str)
                    else ProgramRef.from_json(body["program"])
                ),
                input=body["input"] if patch is None else _input_from_snapshot(body, patch, started),
                budget=Budget.from_json(body["budget"]),
                capabilities=tuple(body["capabilities"]),
                limits_max_pending=tree.limits.max_pending_signals,
                start_effect_id=EffectID(body["start_effect_id"]) if body.get("start_effect_id") else None,
                input_patch=patch,
            )
            if p.parent_id is not None and p.child_key is not None:
                started[(p.parent_id, p.child_key)] = p
            p.status = body["status"]
            p.committed_steps = body["committed_steps"]
            p.prepared_effects = body["usage"]["effects"]
            p.accepted_signals = body["usage"]["signals"]
            p.reserved_signals = body["reserved_signals"]
            p.allocated = Allocation(**body["allocated"])
            p.last_kind = body["last_kind"]
            p.cursor = body["mailbox"]["cursor"]
            p.arrivals = int(body["mailbox"].get("arrivals", len(body["mailbox"]["signals"])))
            p.consumed_through = int(body["mailbox"].get("consumed_through", 0))
            for r in body["mailbox"]["signals"]:
                eid = EffectID(r["effect_id"]) if r.get("effect_id") else None
                sid = SignalID(r["signal_id"]) if "signal_id" in r else settlement_signal_id(eid)  # type: ignore[arg-type]
                record = MailboxRecord(
                    r["arrival"], sid, WaitID(r["wait_id"]) if r.get("wait_id") else None,
                    r.get("payload"), r["source"],
                    SettlementStatus(r["status"]) if r.get("status") else None,
                    eid, bool(r.get("consumed", False)), Digest(r["digest"]) if r.get("digest") else None,
                )
                p.mailbox.append(record)
                p.signal_index[record.signal_id] = record
            for w in body["waits"]:
                wait = WaitRecord(
                    WaitID(w["wait_id"]), WaitKey(w["key"]), w["kind"], EffectID(w["effect_id"]),
                    prompt=w.get("prompt"), response_schema=w.get("response_schema"),
                    spec=ChildWaitSpec.from_json(w["spec"]) if w.get("spec") else None,
                    answered_by=w["answered_by"], closed=w["closed"], satisfied=w.get("satisfied", False),
                )
                p.waits[wait.wait_id] = wait
                if not wait.closed:
                    p.open_wait_keys[wait.key] = wait.wait_id
                    if wait.kind == "children" and not wait.satisfied:
                        p.child_waits[wait.wait_id] = wait
            p.current_wait = WaitID(body["current_wait_id"]) if body["current_wait_id"] else None
            p.pause_reason = body["pause_reason"]
            p.intents = {k: (v["owner"], v["reason"]) for k, v in body["pending_control"].items()}
            if body["prepared"]:
                p.batch_step = body["prepared"]["step"]
                for r in body["prepared"]["effects"]:
                    rec = EffectRecord(
                        EffectID(r["effect_id"]), r["step"], r["index"], r["target"], r["payload"], r["replay"],
                        tuple(r.get("capabilities", ())), r["phase"],
                        SettlementStatus(r["status"]) if r.get("status") else None, r.get("result"),
                        Failure.from_json(r["diagnostic"]) if r.get("diagnostic") else None,
                        EffectAttemptID(r["attempt_id"]) if r.get("attempt_id") else None,
                        TreeIncarnationID(r["incarnation_id"]) if r.get("incarnation_id") else None,
                        r.get("resolved_by"), r.get("attempts", 0), r.get(INPUT_PATCH),
                    )
                    p.batch.append(rec)
                    p.batch_index[rec.effect_id] = rec
            p.children = [ProcessID(c) for c in body["children"]]
            if body["termination"]:
                t = body["termination"]
                p.termination = Termination(
                    t["status"], t["cause"], t["reason"],
                    Failure.from_json(t["failure"]) if t["failure"] else None,
                    tuple(EffectID(x) for x in t["unresolved_effect_ids"]),
                )
            p.output = body["output"]
            if "state" in body and programs is not None:
                program = programs(p.program)
                if program is not None:
                    p.state = program.strategy.decode_state(body["state"])
                    p.has_state = True
            p.ordinal = len(tree.processes)
            tree.processes[p.process_id] = p
            if not p.terminal:
                tree.live[p.process_id] = p
            tree.unknown_ids.update(r.effect_id for r in p.batch if r.unknown)
        for p in tree.processes.values():
            for cid in p.children:
                child = tree.processes[cid]
                assert child.child_key is not None
                p.child_keys[child.child_key] = cid
        tree.kernel_awake = set(tree.live)
        # Children come after their parent: in reverse, each child's count is final first.
        for p in reversed(tree.processes.values()):
            for cid in p.children:
                child = tree.processes[cid]
                p.live_children += not child.terminal
                p.undrained_children += not child.drained
        return tree


_HANDLERS: dict[type, Any] = {
    TreeStarted: TreeState._on_tree_started,
    WriterActivated: TreeState._on_writer_activated,
    ProcessStarted: TreeState._on_process_started,
    SignalAdmitted: TreeState._on_signal_admitted,
    StepCommitted: TreeState._on_step_committed,
    EffectDeclared: TreeState._on_effect_declared,
    EffectDispatched: TreeState._on_effect_dispatched,
    EffectSettled: TreeState._on_effect_settled,
    EffectResolved: TreeState._on_effect_resolved,
    CheckpointCommitted: TreeState._on_checkpoint,
    ControlRequested: TreeState._on_control,
    ProcessTerminated: TreeState._on_terminated,
}


#: Events that may change another Process than their own (``TreeState._touch_relatives``).
_RELATIVES = frozenset({ProcessStarted, ProcessTerminated})


def _input_from_snapshot(body: dict[str, Any], patch: Any, started: dict[tuple[str, str], ProcessState]) -> JSON:
    """A snapshot's Process input written as its ``input_patch`` (``TreeState.to_json``), rebuilt
    from the input of the sibling it names, which was started, and so written, before it."""
    if not isinstance(patch, dict) or set(patch) != {"base", "ops"} or not isinstance(patch["base"], str) \
            or "input" in body:
        raise ValueError(f"process {body['process_id']}: {INPUT_PATCH} is an object with exactly base and ops, "
                         "in place of input")
    base = started.get((body["parent_id"], patch["base"]))
    if base is None:
        raise ValueError(f"process {body['process_id']}: its {INPUT_PATCH} base {patch['base']!r} is no earlier "
                         "child of its parent")
    return apply_changes(base.input, patch["ops"])


def fold_tree(events: Sequence[TreeEvent], programs: ProgramResolver | None = None) -> TreeState:
    """Fold a whole stream from position 1; raises FoldError on the first broken rule."""
    tree = TreeState(programs)
    for event in events:
        tree.apply(event)
    return tree
