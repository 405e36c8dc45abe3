"""The Runtime: drives process trees over an event store.

One owner drives a tree at a time (an owner lease plus version fencing). The owner
turns the kernel's decisions into appends and calls dispatchers only after the
append that grants their dispatch permission is committed (write-ahead). Outcomes
come back to the owner, which records them, runs the next Steps and grants the next
permissions, all in one append: in steady state one Effect costs one append.

Any runtime may admit input to any tree (signals, answers, controls, resolutions)
by appending at the tree's current version; a version conflict means reload and
validate again. When nobody owns the tree, the admitting runtime takes ownership
(``WriterActivated``) and drives it.

Recovery never calls anything: a dispatched Effect whose outcome was not recorded is
dispatched again only when its policy is ``same_identity``; otherwise it settles
unknown and waits for a host (``resolve_unknown_effect``).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import inspect
import itertools
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from eventsourcing.persistence import PersistenceError

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import MAX_SNAPSHOT_BYTES
from agentfold.adapters.dispatch import DispatchCancelled, DispatchContext, TimerDispatcher
from agentfold.adapters.eventstore import CorruptStream, EventStore, LoadedTree, VersionConflict, row_state
from agentfold.adapters.metrics import APPEND_BUCKETS, Counter, Histogram
from agentfold.adapters.recorders import TreeHead
from agentfold.domain.budget import Budget
from agentfold.domain.canonical import JSON, digest_of, normalize
from agentfold.domain.errors import (
    AgentfoldError,
    EngineCode,
    Failure,
    FailureKind,
    Fenced,
    InvalidInput,
    NotFound,
    Rejected,
    StoreFailure,
    recorded_text,
)
from agentfold.domain.events import (
    ControlRequested,
    EffectDeclared,
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    ProcessStarted,
    SignalAdmitted,
    TreeEvent,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import (
    EffectAttemptID,
    EffectID,
    ProcessID,
    StartID,
    TreeID,
    TreeIncarnationID,
    parse_effect_id,
    root_process_id,
)
from agentfold.domain.kernel import Dispatch, Kernel, Progress, brief_repr, check_limits, replay_allowed, start_tree
from agentfold.domain.program import Program, ProgramRef, SettlementStatus, SignalRequest, Target, children_at_once
from agentfold.domain.requests import EffectRequest, Settlement, effect_request
from agentfold.domain.tree import TERMINAL, ProcessState, TreeState

log = logging.getLogger("agentfold.runtime")


_second_text: tuple[int, str] = (-1, "")


def utc_now() -> str:
    """The wall clock as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (every append reads it once).

    ``strftime`` per call was ~4% of the runtime's CPU per effect: the text of the
    current second is kept and only the microseconds are formatted."""
    global _second_text
    micros = time.time_ns() // 1000
    second, fraction = divmod(micros, 1_000_000)
    cached = _second_text
    if cached[0] != second:
        cached = _second_text = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{fraction:06d}Z"


class RandomIds:
    """Fresh attempt and incarnation ids from the operating system's randomness."""

    def attempt_id(self) -> EffectAttemptID:
        return EffectAttemptID.from_bytes(os.urandom(16))

    def incarnation_id(self) -> TreeIncarnationID:
        return TreeIncarnationID.from_bytes(os.urandom(16))

    def root_process_id(self) -> ProcessID:
        return root_process_id(os.urandom(16))

    def start_id(self) -> StartID:
        return StartID("start:" + os.urandom(16).hex())


# ---------------------------------------------------------------------------
# Crash plans (tests and `agentfold run --crash-after`)


@dataclass(slots=True)
class CrashPlan:
    """End the process with ``os._exit(code)`` at one chosen point.

    Points: ``declared:N``, ``dispatched:N``, ``in-dispatch:N``, ``settled:N`` count
    dispatcher Effects in the order their declarations are committed by this process;
    ``after:<EventType>:N`` ends right after the append holding the N-th event of that
    type; ``before:<EventType>:N`` ends instead of making that append.
    """

    point: str
    code: int = 75

    @classmethod
    def parse(cls, text: str, code: int = 75) -> CrashPlan:
        parts = text.split(":")
        valid = (
            len(parts) == 2 and parts[0] in ("declared", "dispatched", "in-dispatch", "settled") and parts[1].isascii() and parts[1].isdigit()
        ) or (len(parts) == 3 and parts[0] in ("after", "before") and bool(parts[1]) and parts[2].isascii() and parts[2].isdigit())
        if not valid or int(parts[-1]) < 1:
            raise InvalidInput(
                "crash.point_invalid",
                f"invalid crash point {text!r}",
                hint="use declared:N, dispatched:N, in-dispatch:N, settled:N, after:<Event>:N or before:<Event>:N",
            )
        return cls(text, code)

    @property
    def kind(self) -> str:
        return self.point.split(":")[0]

    @property
    def n(self) -> int:
        return int(self.point.split(":")[-1])

    @property
    def event_type(self) -> str:
        return self.point.split(":")[1]

    def exit(self) -> None:
        os._exit(self.code)


# ---------------------------------------------------------------------------
# Results and handles


@dataclass(frozen=True, slots=True)
class Result:
    process_id: ProcessID
    status: str
    output: JSON
    termination: dict[str, Any] | None
    usage: dict[str, int]

    @classmethod
    def of(cls, process: ProcessState) -> Result:
        return cls(
            process.process_id,
            process.status,
            process.output,
            process.termination.to_json() if process.termination else None,
            process.usage,
        )

    def to_json(self) -> dict[str, JSON]:
        return {
            "process_id": self.process_id,
            "status": self.status,
            "output": self.output,
            "termination": self.termination,
            "usage": self.usage,
        }


def limits_for(program: Program, limits: TreeLimits | None) -> TreeLimits | None:
    """The tree limits a start of ``program`` stores.

    A Program that says how many children one of its Processes runs at once (an Interaction's
    ``max_concurrent_tool_calls``: ``children_at_once``) gets at least that many from the
    default limits: with the default 16, a window of 20 tool calls failed its 17th call with
    ``engine.child.tree_limit`` in the middle of the run. Limits the caller gave that allow fewer
    are refused (``limits.invalid``) before anything is stored."""
    need, by = children_at_once(program)
    setting = (by.active_children_setting if by is not None else "") or "its active_children"
    if limits is None:
        return TreeLimits(max_active_children=need) if need > TreeLimits().max_active_children else None
    check_limits(limits)
    if by is not None and need > limits.max_active_children:
        raise InvalidInput(
            "limits.invalid",
            f"program {by.ref.name} runs up to {need} children of one Process at once ({setting}) "
            f"but the tree limit max_active_children is {limits.max_active_children}: "
            f"its children beyond {limits.max_active_children} would fail with engine.child.tree_limit",
            hint=f"start it with TreeLimits(max_active_children={need}) or more, or lower {setting}",
        )
    return limits


@dataclass(frozen=True)
class RunHandle:
    """A started or recovered tree."""

    runtime: Runtime
    tree_id: TreeID
    root_process_id: ProcessID
    start_id: StartID

    def result(self, timeout: float | None = None) -> Result:
        """Block until the root Process is terminal and return its Result (its subtree may
        still be ending: ``Runtime.wait_idle`` waits for the whole tree)."""
        return self.runtime.result(self.tree_id, timeout)

    def status(self) -> str:
        return self.runtime.status(self.tree_id)


class RuntimeStopped(AgentfoldError):
    """This runtime stopped driving a tree (store failure or fencing); recover it elsewhere."""

    http_status = 503


# ---------------------------------------------------------------------------
# Driver internals


@dataclass(slots=True)
class _Done:
    process_id: ProcessID
    effect_id: EffectID
    attempt_id: EffectAttemptID
    status: SettlementStatus
    payload: JSON
    diagnostic: Failure | None


@dataclass(slots=True)
class _Call:
    fn: Callable[[Kernel], tuple[list[TreeEvent], Any]]
    future: Future[Any]


@dataclass(slots=True)
class _Refresh:
    pass


@dataclass(slots=True)
class _Kick:
    """Advance again (the previous cycle hit the per-append event cap)."""


MAX_EVENTS_PER_APPEND = 2048
#: Polls at which a tree whose lease was lost is tried again while the store fails, before the
#: watcher gives up on it (logged; ``recover`` adopts it later).
LOST_TREE_ATTEMPTS = 150
#: The same for a tree a failed append stopped (a full disk waits for an operator): ~1 hour of polls.
STALLED_TREE_ATTEMPTS = 18_000
#: Longest stretch (seconds) the watcher spends adopting orphans before its other duties.
ORPHAN_SCAN_SECONDS = 1.0
#: Input recorded on a tree whose lease another runtime held: that holder may have been only
#: passing through (a racing request refused there, a ``recover`` or orphan scan that found the
#: tree parked), and then nobody drives the input. A runtime without a watcher (a CLI command)
#: tries to take the tree over again after each of these pauses (s): beside a live owner, such
#: a request costs their sum. One with a watcher tries at its polls, for TAKE_OVER_SECONDS,
#: the pause doubling from its poll interval: its requests are not delayed.
TAKE_OVER_PAUSES = (0.02, 0.05, 0.1, 0.2)
TAKE_OVER_SECONDS = 10.0
_RESULTS_KEPT = 4096  # results of released finished trees a runtime answers without a load
_FAILED_KEPT = 4096  # errors of owner lines stopped here that result()/wait_idle() raise again


@dataclass(slots=True)
class _Flight:
    process_id: ProcessID
    effect_id: EffectID
    attempt_id: EffectAttemptID
    context: DispatchContext
    cancel_deadline: float | None = None
    # Whether this call still counts against the runtime's calls in flight (``_CallSlots``):
    # until the dispatcher returns, or the call is abandoned.
    holds_slot: bool = True
    # Abandoned with its slot given back while its dispatcher still runs (it holds a spare thread).
    abandoned: bool = False
    # A TimerDispatcher's call: waited for by the runtime's timer thread (``_Timers``), without
    # a slot or a thread of its own.
    timer: _Timer | None = None


@dataclass(frozen=True, slots=True)
class _Job:
    """One dispatcher call whose permission is committed."""

    dispatch: Dispatch
    dispatcher: Any
    request: EffectRequest
    context: DispatchContext
    flight: _Flight


#: Dispatcher calls a runtime has in flight at once, by default (``Runtime(dispatch_workers=N)``,
#: ``serve --dispatch-workers N``), and the most it accepts (each call in flight has its thread).
DEFAULT_DISPATCH_WORKERS = 32
#: Events between a tree's storage snapshots (``Runtime(snapshot_every=...)``): a load folds fewer.
DEFAULT_SNAPSHOT_EVERY = 1000
MAX_DISPATCH_WORKERS = 4096
#: Abandoned calls (cancellation grace over, owner line stopped) whose dispatcher still runs
#: that give their slot back: past that many, an abandoned call keeps its slot until its
#: dispatcher or one of those returns, so that hung calls cannot grow the threads without bound.
SPARE_DISPATCH_THREADS = 256
#: The dispatch pool's own bound, far above what the slots let run (see ``Runtime.__init__``).
POOL_THREADS_BACKSTOP = 1 << 16


class _CallSlots:
    """The runtime's limit on dispatcher calls in flight (``Runtime(dispatch_workers=N)``),
    applied where a dispatch permission is granted, not after it.

    A permission is granted (``EffectDispatched`` appended) only with a free slot, so every
    permitted call starts at once. An Effect that finds none stays declared, without a
    permission, and its tree waits in line; each slot given back goes to the first tree in
    line (in order of arrival), which is woken to grant it. A call queued behind the limit
    after its permission was committed was the problem this replaces: canceled or killed
    meanwhile, it was still made after the run had ended (and recorded unknown "did not
    return" without having started); a server shutting down started queued calls after the
    signal, and left the rest unknown although never called; runs were served in waves of
    ``dispatch_workers``, each to its end. Now a waiting Effect is only declared: a cancel
    ends it without a call, and the next owner dispatches it (never unknown).
    """

    def __init__(self, limit: int, spare: int = 0) -> None:
        self.limit = limit  # checked by Runtime (1 to MAX_DISPATCH_WORKERS)
        self.in_use = 0
        # Abandoned calls whose dispatcher still runs: a slot is given back for at most ``spare``
        # of them, so that calls that never return cannot grow the threads without bound.
        self.spare = spare
        self.abandoned = 0
        # Abandoned calls that kept their slot (no spare was left), oldest first: each takes
        # the place of an abandoned call whose dispatcher returns.
        self._kept: dict[int, _Flight] = {}
        self._lock = threading.Lock()
        self._waiting: collections.OrderedDict[_Driver, None] = collections.OrderedDict()
        self._reserved: dict[_Driver, int] = {}

    def take(self, driver: _Driver) -> bool:
        """One slot for a permission ``driver`` is about to grant; False (``driver`` is put
        in line, once) when none is free."""
        with self._lock:
            held = self._reserved.get(driver, 0)
            if held:
                if held == 1:
                    del self._reserved[driver]
                else:
                    self._reserved[driver] = held - 1
                return True
            if self.in_use < self.limit and not self._waiting:
                self.in_use += 1
                return True
            self._waiting.setdefault(driver, None)
            return False

    def force(self, count: int) -> None:
        """Count calls that are made whatever the limit (re-dispatches decided at activation,
        permissions an append committed although its reply was lost)."""
        if count:
            with self._lock:
                self.in_use += count

    def release(self, count: int = 1) -> None:
        if count <= 0:
            return
        with self._lock:
            self.in_use -= count
            woken = self._hand_out()
        _wake(woken)

    def release_flight(self, flight: _Flight) -> None:
        """The call's dispatcher returned (or it was never called)."""
        with self._lock:
            if flight.abandoned:  # its slot went back already; its spare thread is free now
                flight.abandoned = False
                self.abandoned -= 1
                while self._kept and self.abandoned < self.spare:
                    kept = self._kept.pop(next(iter(self._kept)))
                    self._give_back_abandoned(kept)
            elif flight.holds_slot:
                self._kept.pop(id(flight), None)
                flight.holds_slot = False
                self.in_use -= 1
            else:
                return
            woken = self._hand_out()
        _wake(woken)

    def abandon_flight(self, flight: _Flight) -> None:
        """Nobody here records the call's outcome any more (cancellation grace over, owner line
        stopped): its slot goes back while its dispatcher runs on, unless ``spare`` abandoned
        calls already run: then it keeps its slot (so that hung calls cannot grow the threads
        without bound) until its dispatcher returns or one of those does."""
        with self._lock:
            if not flight.holds_slot or id(flight) in self._kept:
                return
            if self.abandoned >= self.spare:
                self._kept[id(flight)] = flight
                return
            self._give_back_abandoned(flight)
            woken = self._hand_out()
        _wake(woken)

    def _give_back_abandoned(self, flight: _Flight) -> None:
        flight.holds_slot = False
        flight.abandoned = True
        self.abandoned += 1
        self.in_use -= 1

    def give_back_reserved(self, driver: _Driver, *, leave: bool = False) -> None:
        """Slots handed to ``driver`` that its cycle did not use go to the next in line;
        ``leave``: also take it out of the line (a stopped or finished owner line)."""
        if driver not in self._reserved and driver not in self._waiting:
            # Every cycle of every line ends here: most hold nothing and wait for nothing, and
            # skip the lock (a slot handed out after this check comes with a wake-up, whose
            # cycle uses it or gives it back).
            return
        with self._lock:
            held = self._reserved.pop(driver, 0)
            if leave:
                self._waiting.pop(driver, None)
            if not held:
                return
            self.in_use -= held
            woken = self._hand_out()
        _wake(woken)

    def waiting(self) -> int:
        """Trees waiting for a slot to grant a permission."""
        with self._lock:
            return len(self._waiting)

    def _hand_out(self) -> list[_Driver]:
        woken: list[_Driver] = []
        while self._waiting and self.in_use < self.limit:
            driver, _ = self._waiting.popitem(last=False)
            if driver.stopped is not None or driver.finished:
                continue
            self.in_use += 1
            self._reserved[driver] = self._reserved.get(driver, 0) + 1
            woken.append(driver)
        return woken


@dataclass(slots=True, eq=False)
class _Timer:
    """One waiting TimerDispatcher call: ``instant`` on its dispatcher's clock."""

    driver: _Driver
    job: _Job
    instant: float
    tick: float  # the longest wait before its clock is read again (TimerDispatcher.TICK_SECONDS)
    done: bool = False  # fired, stopped, or its owner line gave the tree up
    # The heap's way to this timer (``_Timers._push``), emptied when the timer is done: a stopped
    # timer's heap entry stays until its next look (up to TICK_SECONDS away) and must not hold
    # its owner line, tree and Programs until then.
    slot: list[_Timer | None] | None = None


#: The longest ``TimerDispatcher.TICK_SECONDS`` a runtime accepts (its waits are bounded by it).
MAX_TIMER_TICK = 3600.0


def waits_as_timer(dispatcher: object) -> bool:
    """Whether a runtime waits for this dispatcher's calls on its timer thread: a
    TimerDispatcher whose ``dispatch`` is the stock one. A subclass that overrides ``dispatch``
    is called as an ordinary dispatcher (it blocks a thread and holds a call slot)."""
    return isinstance(dispatcher, TimerDispatcher) and type(dispatcher).dispatch is TimerDispatcher.dispatch


def timer_instant(dispatcher: TimerDispatcher, request: EffectRequest) -> float | Settlement:
    """``dispatcher.due(request)``, checked: a finite instant, or its Settlement now. TypeError
    for anything else (as what ``due`` raises: the owner records the outcome unknown)."""
    instant = dispatcher.due(request)
    if isinstance(instant, Settlement):
        return instant
    if isinstance(instant, bool) or not isinstance(instant, (int, float)) or not math.isfinite(instant):
        raise TypeError(f"due() returned {brief_repr(instant)}, not a finite number of seconds or a Settlement")
    return float(instant)


class _Timers:
    """The runtime's waiting timers (:class:`~agentfold.adapters.dispatch.TimerDispatcher`).

    One thread waits for all of them, in order of the next time each is looked at, which is
    its instant or at most ``TimerDispatcher.TICK_SECONDS`` away (the dispatcher's wall clock is
    read again then: a clock set forward or back is followed). A due timer's outcome goes to its
    owner line like any dispatcher's. Before, a timer was a dispatcher call blocking a thread and
    one of the ``dispatch_workers`` call slots for its whole wait: waiting timers froze every
    other call of the runtime, let a race's timeout win over a worker that never got a slot, and
    fired late behind each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # (monotonic time to look, tie-break, [timer]): the one-element list is emptied when the
        # timer is done before its look (``_forget``), so the entry no longer holds it.
        self._heap: list[tuple[float, int, list[_Timer | None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.waiting = 0  # timers not yet done (GET /metrics)

    def add(self, timer: _Timer) -> None:
        with self._cond:
            if self._closed:
                timer.done = True  # the runtime is closing: the next owner waits for the instant again
                return
            self.waiting += 1
            self._push(timer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentfold-timers", daemon=True)
                self._thread.start()
            self._cond.notify()

    def finish(self, timer: _Timer) -> bool:
        """Mark ``timer`` done; False when it was already (it fired or was stopped before)."""
        with self._cond:
            if timer.done:
                return False
            timer.done = True
            self.waiting -= 1
            self._forget(timer)
            return True

    @staticmethod
    def _forget(timer: _Timer) -> None:
        """Let the heap entry of a timer that is done go of it (the entry itself is dropped at its
        look): a race won by its worker, or a run canceled, was kept with its timer's owner line
        (its tree, its Programs) for up to ``tick`` seconds after it finished."""
        if timer.slot is not None:
            timer.slot[0] = None
            timer.slot = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for _, _, slot in self._heap:
                timer = slot[0]
                if timer is not None and not timer.done:
                    timer.done = True
                    self.waiting -= 1
            self._heap.clear()
            self._cond.notify()

    @staticmethod
    def _remaining(timer: _Timer) -> float | Exception:
        try:
            now = float(timer.job.dispatcher.clock())
            if not math.isfinite(now):
                raise ValueError(f"the clock read {now}")
            return timer.instant - now
        except BaseException as exc:  # noqa: BLE001 - a clock that fails leaves the outcome unknown
            return exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {recorded_text(exc)}")

    def _push(self, timer: _Timer) -> None:
        remaining = self._remaining(timer)
        wait = min(remaining, timer.tick) if isinstance(remaining, float) else 0.0
        slot: list[_Timer | None] = [timer]
        timer.slot = slot
        heapq.heappush(self._heap, (time.monotonic() + max(0.0, wait), next(self._order), slot))

    def _run(self) -> None:
        quiet_stop_signals()
        while True:
            try:
                self._turn()
            except BaseException:  # this thread serves every timer of the runtime
                log.exception("the timer thread failed; it goes on")
                time.sleep(0.1)
            if self._closed:
                return

    def _turn(self) -> None:
        """Settle the due timers, or wait until the next one is to be looked at.

        One or the other per call (the thread's loop calls again): what a turn names (a timer,
        its owner line, and through it a tree and its Programs) is let go when it returns, not
        kept by the waiting thread's frame (a finished run stayed in memory until the next
        timer fired, which might be never)."""
        with self._cond:
            if self._closed:
                return
            now = time.monotonic()
            due = self._take_due(now)
            if not due:
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
                return
        for timer, error in due:
            try:
                timer.driver._timer_settled(timer, error)
            except BaseException:  # one timer's failure is not the others'
                log.exception("timer of effect %s: its outcome could not be handed over", timer.job.dispatch.effect_id)

    def _take_due(self, now: float) -> list[tuple[_Timer, Exception | None]]:
        """The timers due at ``now``, taken off the heap (called with ``_cond`` held)."""
        due: list[tuple[_Timer, Exception | None]] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, slot = heapq.heappop(self._heap)
            timer = slot[0]
            if timer is None or timer.done:
                continue
            remaining = self._remaining(timer)
            if isinstance(remaining, float) and remaining > 0:
                self._push(timer)  # looked at before its instant (a tick, or the clock moved)
                continue
            timer.done = True
            timer.slot = None
            self.waiting -= 1
            due.append((timer, remaining if isinstance(remaining, Exception) else None))
        return due


def _wake(drivers: list[_Driver]) -> None:
    """Have owner lines that were handed a call slot run a cycle to use it."""
    for driver in drivers:
        try:
            driver.submit(_Kick())
        except RuntimeError:  # the runtime is closing (its owner pool takes no more work)
            pass


class _Permits:
    """The dispatch permissions one ``advance`` of an owner line may grant: each takes a call
    slot (``_CallSlots``); a denied one puts the line in wait for a slot."""

    __slots__ = ("denied", "driver", "taken")

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver
        self.taken = 0
        self.denied = False

    def __call__(self, process: ProcessState) -> bool:
        runtime = self.driver.runtime
        if runtime._draining:
            return False
        if runtime._waits_as_timer(process.program):
            return True  # a timer needs no call slot (``_Timers``)
        if self.denied:
            return False  # out of slots for the rest of this advance: no call overtakes the line
        if runtime._slots.take(self.driver):
            self.taken += 1
            return True
        self.denied = True
        return False

    def give_back(self, *, discard: bool = False) -> None:
        """The slots taken for permissions that will not be launched (a failed append);
        ``discard``: the owner line itself is dropped (a start or activation that lost), so
        it also leaves the line for a slot (else it would be woken to drive a tree it does
        not own)."""
        taken, self.taken = self.taken, 0
        driver = self.driver
        slots = driver.runtime._slots
        slots.release(taken)
        if discard:
            # Stopped first: a slot handed to it before now came with a wake-up that is still
            # queued, and its cycle must append nothing (another line, same incarnation, may
            # drive the tree by then: it made a call twice, or released that line's lease).
            with driver.lock:
                if driver.stopped is None:
                    driver.stopped = RuntimeStopped("engine.runtime.released", "a start or activation that lost its race")
            slots.give_back_reserved(driver, leave=True)


class _LeaseLook:
    """A look at a tree under its owner lease (``Runtime._lease_look``)."""

    __slots__ = ("held", "kept")

    def __init__(self, held: Literal["look", "here", "elsewhere"]) -> None:
        self.held = held  # "look": taken for the look; "here" or "elsewhere": not taken
        self.kept = False

    def keep(self) -> None:
        """Keep the lease after the look (the caller adopts the tree next)."""
        self.kept = True


class _Driver:
    """The serial owner line of one tree inside a Runtime."""

    def __init__(self, runtime: Runtime, tree_id: TreeID, loaded: LoadedTree, incarnation: TreeIncarnationID) -> None:
        self.runtime = runtime
        self.tree_id = tree_id
        self.tree = loaded.state
        self.digest = loaded.digest
        self.committed = loaded.state.version
        self.incarnation = incarnation
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self._inbox: collections.deque[Any] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._scheduled = False
        self.flights: dict[EffectID, _Flight] = {}
        self.finished = False
        self._launched: list[_Job] = []
        self._launched_lock = threading.Lock()
        self.stopped: AgentfoldError | None = None
        self.idle = False
        # The last advance left a declared Effect without a permission: no call slot was free
        # (``_CallSlots``); the tree is in line for one and is not idle.
        self.waiting_slot = False
        self.last_snapshot = loaded.snapshot_version
        # Set once this tree's snapshot outgrew MAX_SNAPSHOT_BYTES: it only grows, so the
        # owner line stops serializing snapshots that would not be written.
        self.too_large_to_snapshot = False
        # ``TreeHead.row_state`` of the index row this writer's last append stored; None until
        # its first append, and after another writer's (the stored row is then theirs).
        self.stored_row_state: tuple[str, str, tuple[str, ...]] | None = None
        # The root's Result, set only once an acknowledged append holds its termination:
        # the folded tree may be ahead of the store while an append is in flight or failed.
        self.final: Result | None = None

    # -- inbox ---------------------------------------------------------------

    def submit(self, item: Any) -> None:
        with self._inbox_lock:
            self._inbox.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        self.runtime._owner_pool.submit(self._run)

    def call(self, fn: Callable[[Kernel], tuple[list[TreeEvent], Any]], timeout: float | None = 60.0) -> Any:
        future: Future[Any] = Future()
        self.submit(_Call(fn, future))
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # answered just as the wait ran out
                return future.result()
            # Still queued behind a long pass of the owner line (thousands of Steps): it is
            # applied, or refused, when the line reaches it; nobody hears which.
            raise RuntimeStopped(
                "engine.runtime.busy",
                f"the owner line of tree {self.tree_id} did not take this request within {timeout:g} s: it is "
                "still queued, and is applied (or refused) when the line gets to it",
                hint=f"look at the run later (`agentfold show {self.tree_id}`) before sending it again; a request "
                "sent again with the same signal id is not applied twice",
            ) from None

    def _run(self) -> None:
        """Owner-pool entry: run the cycles, then start every launched dispatcher call."""
        self._run_cycles()
        self.start_jobs(keep_last=False)

    def _run_cycles(self) -> None:
        with self.runtime._busy_cond:
            self.runtime._busy += 1
        try:
            self._drain()
        finally:
            with self.runtime._busy_cond:
                self.runtime._busy -= 1
                if self.runtime._busy == 0:
                    self.runtime._busy_cond.notify_all()
        if self.finished and self.stopped is None:
            self.runtime._forget(self)

    def start_jobs(self, *, keep_last: bool) -> _Job | None:
        """Start the launched calls on the dispatch pool; optionally keep the last for this thread."""
        with self._launched_lock:
            jobs = self._launched
            self._launched = []
        if not jobs:
            return None
        keep = jobs.pop() if keep_last else None
        for job in jobs:
            self.runtime._dispatch_pool.submit(self._dispatch_loop, job)
        return keep

    def _dispatch_loop(self, job: _Job | None) -> None:
        """A dispatch thread: call, record the outcome, and when nobody else is driving the
        tree, drive it here and take the next call too (a chain runs without hand-offs)."""
        while job is not None:
            if self.stopped is not None:
                # The line stopped after this permission was committed (a later cycle of the same
                # pass failed, was fenced, or the tree was released) and gave up the tree: the call
                # is not made here; the next owner decides it (replayed or unknown), as after a crash.
                self.runtime._slots.release_flight(job.flight)
                return
            done = self._call_dispatcher(job)
            with self._inbox_lock:
                self._inbox.append(done)
                if self._scheduled:
                    return
                self._scheduled = True
            self._run_cycles()
            job = self.start_jobs(keep_last=True)

    def _drain(self) -> None:
        while True:
            with self._inbox_lock:
                items = list(self._inbox)
                self._inbox.clear()
                if not items:
                    self._scheduled = False
                    return
            try:
                with self.lock:
                    self._cycle(items)
            except BaseException as exc:  # noqa: BLE001 - never lose the owner line silently
                self._stop(RuntimeStopped("engine.runtime.failed", f"owner of {self.tree_id} failed: {exc!r}"), items)

    # -- the cycle -----------------------------------------------------------

    def _cycle(self, items: list[Any]) -> None:
        if self.stopped is not None:
            self._reject(items, self.stopped)
            return
        if any(isinstance(i, _Refresh) for i in items):
            self._catch_up()
            if self.stopped is not None:
                self._reject(items, self.stopped)
                return
        try:
            self._cycle_attempts(items)
        finally:
            if not self.waiting_slot:
                # Nothing waits for a call slot (any more): out of the line (a paused run, say),
                # and a slot handed to this line that its cycle did not use goes to the next one.
                # A line still waiting keeps its place, and a slot handed to it meanwhile: its
                # wake-up is queued, the next cycle uses it.
                self.runtime._slots.give_back_reserved(self, leave=True)

    def _cycle_attempts(self, items: list[Any]) -> None:
        for _attempt in range(64):
            permits = _Permits(self)
            kernel = Kernel(self.tree, self.runtime._resolve, self.runtime.ids, dispatch=permits)
            events: list[TreeEvent] = []
            replies: list[tuple[Future[Any], Any]] = []
            settled: list[EffectID] = []
            for item in items:
                if isinstance(item, _Done):
                    produced = kernel.settle_dispatch(
                        item.process_id, item.effect_id, item.attempt_id, item.status, item.payload, item.diagnostic
                    )
                    events.extend(produced)
                    settled.append(item.effect_id)
                elif isinstance(item, _Call):
                    if item.future.done():
                        continue
                    version = self.tree.version
                    try:
                        produced, value = item.fn(kernel)
                    except AgentfoldError as exc:
                        if self.tree.version != version:  # pragma: no cover - functions validate before applying
                            raise
                        item.future.set_exception(exc)
                        continue
                    events.extend(produced)
                    replies.append((item.future, value))
            try:
                progress = kernel.advance(MAX_EVENTS_PER_APPEND)
            except BaseException:
                permits.give_back()
                raise
            self.waiting_slot = permits.denied
            events.extend(progress.events)
            if not events:
                for eid in settled:
                    self.flights.pop(eid, None)
                self._after_commit([], replies)
                return
            try:
                self._append(events)
            except VersionConflict:
                permits.give_back()
                self._reload()
                if self.stopped is not None:
                    self._reject(items, self.stopped)
                    return
                self._launch_committed()
                continue
            except (Fenced, StoreFailure) as exc:
                permits.give_back()
                self._stop(exc, items)
                return
            except BaseException:
                permits.give_back()
                raise
            for eid in settled:
                self.flights.pop(eid, None)
            if self.stopped is None and not self.runtime._closed:
                # Closing: a call whose outcome nobody would record is not started; the
                # committed permission is decided by recovery (replay or unknown).
                self._launch(progress.dispatches, permits)
            permits.give_back()
            self._after_commit(events, replies)
            self.more_to_do(progress)
            return
        self._stop(RuntimeStopped("engine.tree.contention", f"tree {self.tree_id} kept changing under its owner"), items)

    def more_to_do(self, progress: Progress) -> None:
        """An advance that stopped at ``MAX_EVENTS_PER_APPEND`` events has more local progress to
        make (a Program taking many Steps without an Effect): the next cycle goes on with it."""
        if len(progress.events) >= MAX_EVENTS_PER_APPEND:
            self.submit(_Kick())

    def _after_commit(self, events: list[TreeEvent], replies: list[tuple[Future[Any], Any]]) -> None:
        for future, value in replies:
            if not future.done():
                future.set_result(value)
        self._cancel_stopping_flights()
        notify = bool(replies)
        if self.final is None and self.tree.root.terminal:
            self.final = Result.of(self.tree.root)
            notify = True
        idle = not self.flights and not self._inbox and not self.waiting_slot
        if idle != self.idle:
            notify = True
        self.idle = idle
        if idle and self.tree.terminal:
            # A finished tree needs no owner: give up the lease and the memory it holds;
            # result() and wait_idle() read it from the store from now on.
            self.finished = True
        if notify:  # waking result()/wait_idle() on every append costs more than the append
            self.cond.notify_all()

    def _reject(self, items: Iterable[Any], exc: AgentfoldError) -> None:
        for item in items:
            if isinstance(item, _Call) and not item.future.done():
                item.future.set_exception(exc.again())

    def _stop(self, exc: AgentfoldError, items: Iterable[Any] = ()) -> None:
        with self.lock:
            if self.stopped is None:
                # A copy, as every error kept to be raised later (``AgentfoldError.again``).
                stopped = exc.again() if isinstance(exc, (Fenced, RuntimeStopped)) \
                    else RuntimeStopped(exc.code, exc.message, exc.hint)
                if stopped.code not in ("engine.runtime.closed", "engine.runtime.released"):
                    # Later result()/wait_idle() calls on this runtime report the failure (Scope:
                    # every published Process's Await returns a RuntimeError), not a stale state.
                    # Written before the line is seen stopped, and only then: a stopped line may be
                    # replaced at once (``_try_adopt``), and the new line's registration clears
                    # this entry, which a later write would bring back over the new line's run.
                    with self.runtime._lock:
                        failed = self.runtime._failed
                        failed[self.tree_id] = stopped
                        failed.move_to_end(self.tree_id)
                        while len(failed) > _FAILED_KEPT:
                            failed.popitem(last=False)
                self.stopped = stopped
            for flight in self.flights.values():
                flight.context.cancelled.set()
                if flight.timer is not None:
                    self.runtime._timers.finish(flight.timer)
                # Abandoned: nobody records its outcome now (the next owner decides it), so it
                # no longer counts against the calls in flight (its thread runs on).
                self.runtime._slots.abandon_flight(flight)
            self.idle = True
            self.runtime._slots.give_back_reserved(self, leave=True)
            # Give up the tree (and its lease) before anyone hears of the stop: a caller
            # told "stopped" may recover the tree at once, from another runtime.
            self.runtime._forget(self)
            if isinstance(exc, StoreFailure) and exc.code not in ("store.closed", "store.corrupt"):
                # An append failed (a full disk, a database that went away): the watcher
                # adopts the tree again once the store takes appends (``_adopt_lost``),
                # instead of leaving it without an owner until someone runs `recover`. A
                # corrupt history (an append refused by the index row) is no outage: no retry
                # would mend it (`agentfold audit verify` says what is wrong).
                self.runtime._stalled(self.tree_id, exc)
            self._reject(items, self.stopped)
            self.cond.notify_all()

    # -- appends -------------------------------------------------------------

    def _append(self, events: list[TreeEvent]) -> None:
        runtime = self.runtime
        crash = runtime.crash
        exit_after = False
        if crash is not None:
            events, exit_after = runtime._crash_check(events)
        expected = self.committed
        version = expected + len(events)
        now = runtime.clock()  # one reading: the events' timestamp and the index row's updated_at
        # A crash plan may cut this append short (``declared:N``): the folded tree is then ahead
        # of what is stored, so the index row carries the stored version, not the folded one.
        # ``stored``: this writer's last append committed at ``expected`` (else this one conflicts),
        # so when only the version moved since, the row keeps its other columns.
        head = index_head(self.tree, self.tree_id, events, now, version=version, stored=self.stored_row_state)
        every = runtime.snapshot_every
        # The interval grows with the tree (1/8 of its length): a snapshot costs in proportion to
        # the tree's size, so this keeps the amortized cost per event constant, while a load
        # still folds at most ~1/8 of the history after the newest snapshot. Only between whole
        # Steps (a load resumes there), and only of exactly what this append stores.
        snapshot = (
            self.tree
            if every
            and not self.too_large_to_snapshot
            and version - self.last_snapshot >= max(every, version // 8)
            and self.tree._expect is None
            and self.tree.version == version
            else None
        )
        # A snapshot is written in the append's own transaction (no second writer competes for
        # the store: on SQLite a background snapshot write held up the next appends, ~20% of a
        # chain's p99 per-effect time), unless it is large (EventStore.INLINE_SNAPSHOT_BYTES):
        # then its JSON comes back and is deflated and written off the owner line.
        began = time.perf_counter()
        result = runtime.store.append(
            self.tree_id, expected, events, previous_digest=self.digest, timestamp=now, head=head, snapshot=snapshot
        )
        runtime.append_seconds.observe(time.perf_counter() - began)
        if crash is not None and exit_after:
            crash.exit()
        self.digest = result.digest
        self.committed = version
        self.stored_row_state = head.row_state
        if snapshot is not None:
            self.last_snapshot = version
        if result.snapshot_body is not None:
            # Written off the owner line; one over the bound is refused there (and logged), once.
            self.too_large_to_snapshot = len(result.snapshot_body) > MAX_SNAPSHOT_BYTES
            runtime._snapshot_pool.submit(self._write_snapshot, version, result.snapshot_body)
        runtime.appends += 1
        runtime.events_appended += len(events)
        if self.committed != self.tree.version:  # pragma: no cover - defensive
            raise RuntimeStopped("engine.runtime.failed", "the folded tree and the committed version diverged")

    def _write_snapshot(self, version: int, body: bytes) -> None:
        """Deflate and store a large snapshot's JSON, off the owner line (it is a cache: a
        failure only means the next load folds more events)."""
        try:
            self.runtime.store.write_snapshot(self.tree_id, version, body)
        except Exception as exc:  # noqa: BLE001 - the next snapshot will be taken later
            log.debug("tree %s: snapshot at %d not written: %s", self.tree_id, version, exc)

    def _reload(self) -> None:
        """Discard uncommitted state and fold the tree again from the store."""
        try:
            loaded = self.runtime.store.load(self.tree_id, self.tree.programs or self.runtime._resolve)
        except AgentfoldError as exc:
            self._stop(exc)
            return
        if loaded.state.incarnation != self.incarnation:
            # Fenced: never adopt (or publish) a state another writer produced.
            self._fence(loaded.state.incarnation)
            return
        self.tree = loaded.state
        self.digest = loaded.digest
        self.committed = loaded.state.version
        self.stored_row_state = None

    def _catch_up(self) -> None:
        """Fold events other writers appended after our committed version."""
        try:
            records = self.runtime.store.read(self.tree_id, after=self.committed, previous_digest=self.digest)
            for record in records:
                if isinstance(record.event, WriterActivated):
                    self._fence(record.event.incarnation_id)
                    return
                self.tree.apply(record.event, record.position)
                self.digest = record.digest
                self.committed = record.position
                self.stored_row_state = None  # the index row is another writer's now
        except Exception:  # noqa: BLE001 - fall back to a full reload
            self._reload()
            return
        self._check_fence()

    def _check_fence(self) -> None:
        if self.tree.incarnation != self.incarnation:
            self._fence(self.tree.incarnation)

    def _fence(self, other: TreeIncarnationID | None) -> None:
        self._stop(
            Fenced(
                "engine.tree.incarnation_conflict",
                f"tree {self.tree_id} was activated by incarnation {other}; this writer ({self.incarnation}) stops",
            )
        )

    # -- dispatch ------------------------------------------------------------

    def _launch_committed(self) -> None:
        """Launch the dispatch permissions this writer committed without learning it.

        An append whose reply was lost is retried (agentfold.adapters.recorders); if another writer
        appended in between, the retry is a conflict although the first attempt committed.
        The reloaded tree then holds this incarnation's permission with no call behind it:
        without this, the Effect stayed pending under a live owner and the tree never moved.
        """
        committed = [
            Dispatch(process.process_id, record.effect_id, record.attempt_id)
            for process in self.tree.live.values()
            for record in process.in_flight()
            if record.target == Target.DISPATCHER
            and record.incarnation_id == self.incarnation
            and record.attempt_id is not None
            and record.effect_id not in self.flights
        ]
        if committed:
            log.warning("tree %s: launching %d dispatch permission(s) an append committed although its reply was lost",
                        self.tree_id, len(committed))
            self._launch(committed)

    def _launch(self, dispatches: Sequence[Dispatch], permits: _Permits | None = None) -> None:
        """Start a flight for each committed permission. Each holds a call slot: the ones
        ``permits`` took for them, and any other is counted beyond the limit (a permission is
        a call this runtime makes, once committed)."""
        slots = self.runtime._slots
        covered = min(permits.taken, len(dispatches)) if permits is not None else 0
        if permits is not None:
            permits.taken -= covered
        slots.force(len(dispatches) - covered)
        for dispatch in dispatches:
            context = DispatchContext()
            flight = _Flight(dispatch.process_id, dispatch.effect_id, dispatch.attempt_id, context)
            self.flights[dispatch.effect_id] = flight
            try:
                # Inside: a catalog that raises must not leave this and the later flights' slots taken.
                program = self.runtime._resolve(self.tree.processes[dispatch.process_id].program)
                request = effect_request(self.tree, dispatch.process_id, dispatch.effect_id, program, dispatch.attempt_id)
            except Exception as exc:  # noqa: BLE001
                slots.release_flight(flight)
                self.submit(_unknown(dispatch, EngineCode.DISPATCH_FAILED, f"cannot build the request: {recorded_text(exc)}"))
                continue
            dispatcher = program.dispatcher if program is not None else None
            if dispatcher is None:
                slots.release_flight(flight)
                self.submit(_unknown(dispatch, EngineCode.DISPATCH_FAILED, "no dispatcher is bound to this program"))
                continue
            job = _Job(dispatch, dispatcher, request, context, flight)
            if waits_as_timer(dispatcher):
                slots.release_flight(flight)  # a timer holds no call slot while it waits
                if self._stopping(dispatch.process_id):
                    # Made again by a takeover that then recorded a cancel (``Runtime._activate``):
                    # stopped before it is armed (armed, an overdue one could fire first).
                    self._timer_done(self._timer_stopped(job))
                else:
                    self._start_timer(job)
                continue
            with self._launched_lock:
                self._launched.append(job)

    def _start_timer(self, job: _Job) -> None:
        """Hand a TimerDispatcher's call to the runtime's timer thread (``_Timers``)."""
        try:
            tick = job.dispatcher.TICK_SECONDS
            if isinstance(tick, bool) or not isinstance(tick, (int, float)) or not 0 < tick <= MAX_TIMER_TICK:
                raise TypeError(f"{type(job.dispatcher).__name__}.TICK_SECONDS is {brief_repr(tick)}, not a number "
                                f"of seconds above 0 and at most {MAX_TIMER_TICK:g}")
            instant = timer_instant(job.dispatcher, job.request)
            if isinstance(instant, Settlement):
                self._timer_done(_settled(job.dispatch, instant))
                return
        except BaseException as exc:  # noqa: BLE001 - as a dispatcher that raises: the outcome is unknown
            self._timer_done(_unknown(job.dispatch, EngineCode.DISPATCH_FAILED, f"{type(exc).__name__}: {recorded_text(exc)}"))
            return
        timer = _Timer(self, job, float(instant), float(tick))
        job.flight.timer = timer
        self.runtime._timers.add(timer)

    def _stopping(self, process_id: ProcessID) -> bool:
        """Whether the Process takes no other call: it ended, or it or an ancestor is ending (an
        ancestor's intent reaches it in a later pass when this one stopped at its size limit)."""
        process = self.tree.processes.get(process_id)
        return process is None or process.terminal or self.tree.ending(process) is not None

    @staticmethod
    def _timer_stopped(job: _Job) -> _Done:
        """The outcome of a timer stopped before its instant: its dispatcher's ``stopped``."""
        try:
            return _settled(job.dispatch, job.dispatcher.stopped(job.request))
        except BaseException as exc:  # noqa: BLE001 - asyncio.CancelledError too: the outcome is unknown
            return _unknown(job.dispatch, EngineCode.DISPATCH_FAILED, f"{type(exc).__name__}: {recorded_text(exc)}")

    def _timer_settled(self, timer: _Timer, error: Exception | None = None, *, stopped: bool = False) -> None:
        """A timer fired (``error``: its clock failed) or its Process is stopping (``stopped``):
        its outcome goes to this owner line, unless the line gave the tree up meanwhile (the
        next owner waits for the instant again)."""
        job = timer.job
        if self.stopped is not None or self.flights.get(job.dispatch.effect_id) is not job.flight:
            return
        if error is not None:
            done = _unknown(job.dispatch, EngineCode.DISPATCH_FAILED, f"the timer's clock failed: {type(error).__name__}: {error}")
        elif stopped:
            done = self._timer_stopped(job)
        else:
            try:
                done = _settled(job.dispatch, job.dispatcher.fired(job.request))
            except BaseException as exc:  # noqa: BLE001 - asyncio.CancelledError too: the outcome is unknown
                done = _unknown(job.dispatch, EngineCode.DISPATCH_FAILED, f"{type(exc).__name__}: {recorded_text(exc)}")
        self._timer_done(done)

    def _timer_done(self, done: _Done) -> None:
        runtime = self.runtime
        runtime.calls_settled.add(done.status.value)
        crash = runtime.crash
        if crash is not None and crash.kind == "in-dispatch" and runtime._ordinal.get(done.effect_id) == crash.n:
            crash.exit()  # the timer gave its outcome; it is not recorded (as a dispatcher's after its call)
        try:
            self.submit(done)
        except RuntimeError:  # the runtime is closing: the next owner waits for the instant again
            pass

    def _call_dispatcher(self, job: _Job) -> _Done:
        runtime = self.runtime
        dispatch, dispatcher, request, context = job.dispatch, job.dispatcher, job.request, job.context
        with runtime._calls_lock:
            runtime._calls_running += 1
        try:
            settlement = dispatcher.dispatch(request, context)
            done = _settled(dispatch, settlement)
        except DispatchCancelled as exc:
            done = _unknown(dispatch, EngineCode.DISPATCH_CANCELED, str(exc) or "canceled")
        except TimeoutError as exc:
            done = _unknown(dispatch, EngineCode.DISPATCH_DEADLINE, f"timed out: {recorded_text(exc)}")
        except Exception as exc:  # noqa: BLE001 - every raised error leaves the outcome unknown
            code = EngineCode.DISPATCH_CANCELED if context.cancelled.is_set() else EngineCode.DISPATCH_FAILED
            done = _unknown(dispatch, code, f"{type(exc).__name__}: {recorded_text(exc)}")
        except BaseException as exc:  # noqa: BLE001 - not an Exception, and still a call whose outcome is unknown
            # asyncio.CancelledError (a dispatcher bridging to an event loop), SystemExit, ...: left
            # to escape, it ended this thread without a settlement, and the Effect stayed in flight
            # under a live owner for good (nobody else may recover a tree whose lease is held).
            # asyncio is looked up, not imported: a process that never imported it cannot have raised
            # its CancelledError, and every command line would pay the import (~20 ms).
            cancelled_error = getattr(sys.modules.get("asyncio"), "CancelledError", None)
            cancelled = (isinstance(cancelled_error, type) and isinstance(exc, cancelled_error)) or context.cancelled.is_set()
            code = EngineCode.DISPATCH_CANCELED if cancelled else EngineCode.DISPATCH_PANICKED
            done = _unknown(dispatch, code, f"{type(exc).__name__}: {recorded_text(exc)}")
        finally:
            with runtime._calls_lock:
                runtime._calls_running -= 1
            runtime._slots.release_flight(job.flight)
        runtime.calls_settled.add(done.status.value)
        crash = runtime.crash
        if crash is not None and crash.kind == "in-dispatch" and runtime._ordinal.get(dispatch.effect_id) == crash.n:
            crash.exit()
        return done

    def drained(self, seconds: float) -> bool:
        """Nothing under way that could still be recorded within ``seconds`` (``Runtime.drain``):
        nothing to append, no call in flight but timers due later that the next owner makes
        again (a timer with replay policy ``never`` is waited for as any call)."""
        if not self.flights:
            return not self._inbox and not self._scheduled
        if not self.lock.acquire(blocking=False):
            return False  # the owner line is in a cycle: it may be launching a call
        try:
            # Effects waiting for a call slot are none of it: no permission is granted any more.
            return self.far_timers(seconds) is not None
        finally:
            self.lock.release()

    def far_timers(self, seconds: float) -> list[tuple[EffectID, float]] | None:
        """When this owner line has nothing under way but waiting timers each due more than
        ``seconds`` from now (by its dispatcher's clock): ``(effect id, seconds until due)`` for
        each; otherwise None. Only timers the next owner makes again (replay policy
        ``same_identity``) count; another one would be recorded unknown when abandoned. Declared
        Effects waiting for a call slot (``waiting_slot``) are the caller's to weigh. Called with
        the driver's lock held. A timer overdue but not yet fired is waited for."""
        if self._inbox or self._scheduled:
            return None
        flights = list(self.flights.values())
        timers = self.waiting_timers(flights)
        if not flights or len(timers) != len(flights):
            return None  # nothing in flight, or a call that is no waiting timer
        seconds = max(seconds, 0.0)
        far: list[tuple[EffectID, float]] = []
        for flight, left in timers:
            process = self.tree.processes.get(flight.process_id)
            record = process.effect(flight.effect_id) if process is not None else None
            if (
                record is None or process is None or not isinstance(left, float) or left <= seconds
                or not replay_allowed(self.runtime._resolve(process.program), record)  # as the next owner decides
            ):
                return None
            far.append((flight.effect_id, left))
        return far

    @staticmethod
    def waiting_timers(flights: Iterable[_Flight]) -> list[tuple[_Flight, float | Exception]]:
        """The flights that are timers still waiting, with the seconds until each is due by its
        dispatcher's clock (the clock's failure, if reading it failed)."""
        return [(f, _Timers._remaining(f.timer)) for f in flights if f.timer is not None and not f.timer.done]

    def _cancel_stopping_flights(self) -> None:
        now = time.monotonic()
        for flight in list(self.flights.values()):
            process = self.tree.processes.get(flight.process_id)
            stopping = process is None or process.terminal_intent is not None or process.terminal
            if not stopping:
                continue
            if flight.timer is not None:  # a waiting timer stops at once (no grace, never unknown)
                flight.context.cancelled.set()
                if self.runtime._timers.finish(flight.timer):
                    self._timer_settled(flight.timer, stopped=True)
                continue
            if not flight.context.cancelled.is_set():
                flight.context.cancelled.set()
                flight.cancel_deadline = now + self.runtime.cancel_grace
                timer = threading.Timer(self.runtime.cancel_grace, self._abandon, (flight,))
                timer.daemon = True
                timer.start()

    def _abandon(self, flight: _Flight) -> None:
        """A dispatcher ignored cancellation past the grace period: its outcome is unknown.
        Its slot goes back (its thread stays with it until the dispatcher returns)."""
        self.runtime._slots.abandon_flight(flight)
        if flight.effect_id in self.flights:
            try:
                self.submit(
                    _Done(
                        flight.process_id, flight.effect_id, flight.attempt_id, SettlementStatus.UNKNOWN, None,
                        Failure(FailureKind.EXTERNAL, EngineCode.DISPATCH_CANCELED,
                                "the dispatcher did not return within the cancellation grace period"),
                    )
                )
            except RuntimeError:
                # The runtime closed during the grace period (its owner pool takes no more
                # work): whoever drives the tree next records the call unknown, as after a crash.
                pass


def _store_down(exc: BaseException) -> bool:
    """A failure of the store that may pass (try again later), as opposed to a corrupt history
    or a refusal that would repeat."""
    return (
        isinstance(exc, (StoreFailure, PersistenceError, OSError))
        and not isinstance(exc, CorruptStream)
        and getattr(exc, "code", None) != "store.closed"  # closed by this process: it will not come back
    )


def quiet_stop_signals() -> None:
    """Keep SIGINT and SIGTERM away from this thread (the runtime's own threads).

    A signal sent to the process goes to any thread that does not block it. Taken by a
    dispatch thread stuck in a tool call, Ctrl-C never reached the main thread, whose
    wait (``result``, ``wait_idle``) it should interrupt: a CLI command went on until its
    timeout. Blocked here, the main thread (or a signal-waiting thread) gets them.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


#: The failure kind of an unknown outcome's diagnostic, by its code (else ``external``).
_UNKNOWN_KINDS = {EngineCode.DISPATCH_SETTLEMENT_INVALID: FailureKind.CONTRACT,
                  EngineCode.DISPATCH_PANICKED: FailureKind.PANIC}


def _unknown(dispatch: Dispatch, code: str, message: str) -> _Done:
    return _Done(
        dispatch.process_id, dispatch.effect_id, dispatch.attempt_id, SettlementStatus.UNKNOWN, None,
        Failure(_UNKNOWN_KINDS.get(code, FailureKind.EXTERNAL), code, message or code),
    )


def _settled(dispatch: Dispatch, settlement: Any) -> _Done:
    if not isinstance(settlement, Settlement) or not isinstance(settlement.status, SettlementStatus):
        if inspect.iscoroutine(settlement):
            settlement.close()  # never run (nothing here awaits): no "was never awaited" warning
        return _unknown(dispatch, EngineCode.DISPATCH_SETTLEMENT_INVALID, f"dispatcher returned {type(settlement).__name__}")
    if settlement.status is SettlementStatus.UNKNOWN:
        return _unknown(dispatch, EngineCode.DISPATCH_FAILED, "the dispatcher reported an unknown outcome")
    try:
        payload = normalize(settlement.payload, what="settlement payload")
    except InvalidInput as exc:
        return _unknown(dispatch, EngineCode.DISPATCH_SETTLEMENT_INVALID, exc.message)
    return _Done(dispatch.process_id, dispatch.effect_id, dispatch.attempt_id, settlement.status, payload, None)


# ---------------------------------------------------------------------------
# The Runtime


def _is_seconds(value: Any, *, negative: bool = False) -> bool:
    """A number of seconds a lock or timer can wait: an int or float (not a bool), finite, at
    most ``threading.TIMEOUT_MAX`` (~292 years; above it a wait raises OverflowError, and an int
    beyond a float's range cannot even be compared), and 0 or more unless ``negative``."""
    try:
        return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and (
            value >= 0 or negative) and abs(value) <= threading.TIMEOUT_MAX
    except OverflowError:
        return False


def _seconds_argument(value: Any, what: str, *, none: bool = False, negative: bool = False) -> None:
    """Refuse a wait's bound that is no number of seconds (``_is_seconds``, ``runtime.invalid``)
    before anything changes: ``None`` only where it means no bound (``none``), below 0 only where
    it means "do not wait" (``negative``). Else a bare TypeError, ValueError or OverflowError came
    from inside, a negative one waited for good in ``Condition.acquire``, ``True`` was 1 s."""
    if value is None and none:
        return
    if not _is_seconds(value, negative=negative):
        raise InvalidInput(
            "runtime.invalid", f"{what} is a number of seconds"
            + (" from 0" if not negative else "") + f" up to {threading.TIMEOUT_MAX:.0f}, not {brief_repr(value)}",
            hint="None waits without a bound" if none else "pass a finite number, e.g. 30",
        )


def _check_settings(store: Any, catalog: Any, *, dispatch_workers: Any, owner_workers: Any, snapshot_every: Any,
                    poll_interval: Any, cancel_grace: Any, adopt_orphans_every: Any) -> None:
    """Refuse a Runtime built with arguments it cannot run with (``runtime.invalid``), before it
    starts a thread (a bare AttributeError or TypeError from inside, otherwise)."""
    def refuse(message: str, hint: str) -> InvalidInput:
        return InvalidInput("runtime.invalid", message, hint=hint)

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(store, EventStore) and not all(callable(getattr(store, n, None)) for n in ("append", "leases")):
        # (a wrapper that passes an EventStore's methods through is fine: tests inject faults so)
        raise refuse(f"a Runtime needs an EventStore, not {type(store).__name__}",
                     'open one first: EventStore("sqlite:///agentfold.db") (agentfold.adapters.eventstore)')
    if catalog is not None and not isinstance(catalog, Catalog):
        raise refuse(f"catalog must be a Catalog, not {type(catalog).__name__}",
                     "pass Catalog([program, ...]) (agentfold.adapters.catalog), or None")
    if not whole(dispatch_workers) or not 1 <= dispatch_workers <= MAX_DISPATCH_WORKERS:
        raise refuse(f"dispatch_workers must be from 1 to {MAX_DISPATCH_WORKERS}, got {dispatch_workers!r}",
                     "the most dispatcher calls in flight at once (default 32)")
    if not whole(owner_workers) or not 1 <= owner_workers <= MAX_DISPATCH_WORKERS:
        raise refuse(f"owner_workers must be from 1 to {MAX_DISPATCH_WORKERS}, got {owner_workers!r}",
                     "the threads that drive trees (default 4)")
    if not whole(snapshot_every) or snapshot_every < 0:
        raise refuse(f"snapshot_every must be a whole number of events, 0 or more, got {snapshot_every!r}",
                     "the least events between storage snapshots (default 1000); 0 stores none")
    for name, value in (("poll_interval", poll_interval), ("cancel_grace", cancel_grace),
                        ("adopt_orphans_every", adopt_orphans_every)):
        if not _is_seconds(value):
            raise refuse(f"{name} must be a number of seconds, 0 or more, got {value!r}",
                         "poll_interval: how often the watcher looks at other writers (0: no watcher); "
                         "cancel_grace: how long a canceled call may finish; adopt_orphans_every: 0 = never")


class Runtime:
    """Starts, drives, recovers and serves process trees over one event store."""

    def __init__(
        self,
        store: EventStore,
        catalog: Catalog | None = None,
        *,
        dispatch_workers: int = DEFAULT_DISPATCH_WORKERS,
        owner_workers: int = 4,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        poll_interval: float = 0.2,
        cancel_grace: float = 5.0,
        crash: CrashPlan | None = None,
        clock: Callable[[], str] = utc_now,
        ids: RandomIds | None = None,
        adopt_on_admit: bool = True,
        adopt_orphans_every: float = 0.0,
    ) -> None:
        _check_settings(store, catalog, dispatch_workers=dispatch_workers, owner_workers=owner_workers,
                        snapshot_every=snapshot_every, poll_interval=poll_interval, cancel_grace=cancel_grace,
                        adopt_orphans_every=adopt_orphans_every)
        self.store = store
        self.catalog = catalog or Catalog()
        self.snapshot_every = snapshot_every
        self.poll_interval = poll_interval
        self.cancel_grace = cancel_grace
        self.crash = crash
        self.clock = clock
        self.ids = ids or RandomIds()
        self.adopt_on_admit = adopt_on_admit
        # Seconds between scans for live trees nobody owns (a dead peer's runs); 0 = never.
        self.adopt_orphans_every = adopt_orphans_every
        self.orphans_adopted = 0
        self.recovered = 0  # trees ``recover`` adopted (``serve --recover`` at startup, `agentfold recover`)
        # The live trees the last store-wide ``recover()`` could not take, with why.
        self.recover_failures: dict[TreeID, AgentfoldError] = {}
        self.appends = 0
        self.events_appended = 0
        # What GET /metrics reports (agentfold.adapters.metrics): the commit time of every
        # append, and the outcome of every dispatcher call, since this runtime started.
        self.append_seconds = Histogram(APPEND_BUCKETS)
        self.calls_settled = Counter()
        self.dispatch_workers = dispatch_workers
        self._slots = _CallSlots(dispatch_workers, SPARE_DISPATCH_THREADS)
        # The slots bound the threads (calls in flight, up to SPARE_DISPATCH_THREADS abandoned ones,
        # the few re-dispatches counted beyond the limit, threads finishing an owner cycle after
        # their call); the pool itself must never queue a permitted call behind busy threads, so
        # its own bound is only a backstop (it starts a thread only when none is idle).
        self._dispatch_pool = ThreadPoolExecutor(
            POOL_THREADS_BACKSTOP, thread_name_prefix="agentfold-dispatch", initializer=quiet_stop_signals,
        )
        self._calls_lock = threading.Lock()
        self._calls_running = 0  # dispatcher calls inside a dispatcher right now
        self._timers = _Timers()  # TimerDispatcher calls waiting for their instant
        self._owner_pool = ThreadPoolExecutor(
            owner_workers, thread_name_prefix="agentfold-owner", initializer=quiet_stop_signals
        )
        self._snapshot_pool = ThreadPoolExecutor(  # large snapshots
            1, thread_name_prefix="agentfold-snapshot", initializer=quiet_stop_signals
        )
        self._drivers: dict[TreeID, _Driver] = {}
        # Re-entrant: an owner line that stops while its tree is being taken (its lease lost
        # before its registration) gives the tree up, under the same lock, on the same thread.
        self._adopt_locks = [threading.RLock() for _ in range(64)]
        # The errors of owner lines that stopped here (fenced, a failed append or cycle), raised
        # again by result()/wait_idle(); bounded, newest kept, as ``_results``: a tree another
        # writer took over and finished was kept here for the runtime's life (~1.3 KB each).
        self._failed: collections.OrderedDict[TreeID, AgentfoldError] = collections.OrderedDict()
        # Unknown Effects a host is replaying through this runtime now (Scope: while a replay
        # is in flight, another replay or a resolution of that Effect is ErrEffectNotPending).
        self._replaying: set[EffectID] = set()
        # Trees whose owner line stopped because the lease session ended: adopted again
        # by the watcher once leases work (see ``_adopt_lost``).
        self._lost: dict[TreeID, int] = {}  # tree -> failed attempts to adopt it again
        # tree -> (next try, pause, until, version) for input recorded while another runtime held its lease
        self._left: dict[TreeID, tuple[float, float, float, int]] = {}
        # tree -> (incarnation, committed version, digest) of the owner line a lost lease stopped
        self._lost_line: dict[TreeID, tuple[TreeIncarnationID, int, str | None]] = {}
        self._stalled_trees: set[TreeID] = set()  # of those, the ones a failed append stopped
        #: The failure of the latest append that stopped a tree (``GET /health`` names its code).
        self.last_stall: StoreFailure | None = None
        # Acknowledged results of trees this runtime finished and released (bounded, newest kept).
        self._results: collections.OrderedDict[TreeID, Result] = collections.OrderedDict()
        # Trees a request of this runtime took under its lease and left as they were (nothing to
        # decide or drive), with the version they had then (``drives``).
        self._quiet: collections.OrderedDict[TreeID, int] = collections.OrderedDict()
        self._busy = 0  # owner lines inside a cycle (possibly inside a store call)
        self._busy_cond = threading.Condition()
        self._shut = False
        self._lock = threading.RLock()
        self._leases = store.leases()
        self._ordinal: dict[EffectID, int] = {}
        self._counts: dict[str, int] = collections.Counter()
        self._closed = False
        self._draining = False  # see drain(): no dispatch permission is granted any more
        self._watcher: threading.Thread | None = None
        self._watcher_lock = threading.Lock()  # not _lock: a thread's start must not hold up _forget
        self._watch_stop = threading.Event()
        # The orphan scan's memory: parked trees found with nothing to drive, and trees that
        # could not be adopted, each at the stored version it was seen at (looked at again
        # only once someone appends to it).
        self._orphans_parked: dict[TreeID, int] = {}
        self._orphans_refused: dict[TreeID, int] = {}
        self._next_orphan_scan = 0.0
        if adopt_orphans_every > 0:
            self._ensure_watcher()

    # -- programs ------------------------------------------------------------

    def _resolve(self, ref: ProgramRef) -> Program | None:
        return self.catalog.resolve(ref)

    def _waits_as_timer(self, ref: ProgramRef) -> bool:
        """Whether the calls of this Program wait on the timer thread (no call slot). Asked of
        the Program (held by its tree) each time, not remembered by ref: a long-lived runtime
        kept one entry per Program it ever drove, and every scenario document is a Program."""
        try:
            program = self._resolve(ref)
        except Exception:  # noqa: BLE001 - an ordinary call: _launch reports the catalog's failure
            return False
        return program is not None and waits_as_timer(program.dispatcher)

    def _load(self, tree_id: TreeID) -> LoadedTree:
        """Load a tree with its Programs bound (rebuilding a stored configuration if needed);
        the tree holds them for as long as it is held (``Catalog.bound``)."""
        return self.store.load(tree_id, self.catalog.bound(self._bind_programs(tree_id)))

    def _bind_programs(self, tree_id: TreeID) -> Program:
        first = self.store.first_event(tree_id)
        if first is None:
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
        started = first.event
        if not isinstance(started, TreeStarted):
            raise CorruptStream(tree_id, 1, "stream.first_event",
                                f"the first event must be TreeStarted, got {type(started).__name__}")
        return self.catalog.load(started.program, started.configuration)

    # -- lookups -------------------------------------------------------------

    def tree_of(self, ref: str) -> TreeID:
        """Resolve a tree id, a start id or a process id to a tree id."""
        return self.store.find_tree(ref)

    def tree_of_process(self, process_id: ProcessID) -> TreeID:
        return self.store.find_process_tree(process_id)

    # -- start ---------------------------------------------------------------

    def start(
        self,
        program: Program,
        input: JSON = None,
        *,
        start_id: str | None = None,
        budget: Budget | None = None,
        capabilities: Sequence[str] = (),
        limits: TreeLimits | None = None,
        configuration: JSON = None,
    ) -> RunHandle:
        """Start a root Process; starting again with the same start id returns the same tree.

        The same start id with a different program or input is refused with
        ``engine.start.conflict``.
        """
        self._check_open()
        if not isinstance(program, Program):
            raise InvalidInput("program.invalid", f"start needs a Program, not {type(program).__name__}",
                               hint="pass the Program to run (agentfold.domain.program.Program)")
        limits = limits_for(program, limits)
        self.catalog.add(program)
        sid = StartID(start_id) if start_id is not None else self.ids.start_id()
        tree_id = TreeID.for_start(sid)
        started = start_tree(
            program, input, start_id=sid, root_id=self.ids.root_process_id(), incarnation_id=self.ids.incarnation_id(),
            budget=budget, capabilities=capabilities, limits=limits,
            configuration=configuration if configuration is not None else program.configuration,
        )
        existing = self.store.head(tree_id)
        if existing is not None:
            return self._existing_start(tree_id, started)
        # Under the tree's adoption lock, as ``_try_adopt``: leases are re-entrant inside one
        # process, so without it a concurrent start of the same id, or the watcher adopting the
        # tree again after a lost lease session, could activate it between this start's append
        # and its owner line's registration (two owner lines; a call recorded unknown, or made twice).
        with self._adopt_lock(tree_id):
            driver = self._start_owned(tree_id, started)
        if driver is None:
            return self._existing_start(tree_id, started)
        driver.start_jobs(keep_last=False)
        self._ensure_watcher()
        return RunHandle(self, tree_id, started.process_id, sid)

    def _start_owned(self, tree_id: TreeID, started: TreeStarted) -> _Driver | None:
        """Append the tree's first Steps under its lease and register its owner line (called with
        the tree's adoption lock held); None when another start or owner got there first."""
        with self._lock:
            if tree_id in self._drivers or self._closed:
                return None
        if not self._leases.acquire(tree_id):
            return None
        try:
            tree = TreeState(self.catalog.bound(self.catalog.load(started.program, started.configuration)))
            tree.apply(started)
        except BaseException:
            self._leases.release(tree_id)  # nothing stored: another start of this id may go ahead
            raise
        driver = _Driver(self, tree_id, LoadedTree(TreeState(tree.programs), None), started.incarnation_id)
        with driver.lock:
            driver.tree = tree
            driver.committed = 0
            permits = _Permits(driver)
            try:
                progress = Kernel(tree, self._resolve, self.ids, dispatch=permits,
                                  interruptible=_on_main_thread()).advance(MAX_EVENTS_PER_APPEND)
            except BaseException:
                permits.give_back(discard=True)
                # Nothing stored: kept, the lease refused every other runtime's start of this id
                # (engine.start.in_progress) until this one closed.
                self._leases.release(tree_id)
                raise
            driver.waiting_slot = permits.denied
            try:
                driver._append([started, *progress.events])
            except VersionConflict:
                permits.give_back(discard=True)
                self._leases.release(tree_id)
                return None
            except BaseException:
                permits.give_back(discard=True)
                self._leases.release(tree_id)
                raise
            if not self._register(driver):
                permits.give_back(discard=True)
                return driver
            driver._launch(progress.dispatches, permits)
            permits.give_back()
            driver._after_commit([], [])
            driver.more_to_do(progress)
        return driver

    def _register(self, driver: _Driver) -> bool:
        """Make ``driver`` the tree's owner line, after its first append; False (the line is
        stopped) when the lease was lost meanwhile.

        The watcher found no owner line to stop when the lease session ended during the start
        or the activation: nothing is dispatched without a lease, and the watcher adopts the
        tree again once a new session works."""
        tree_id = driver.tree_id
        with self._lock:
            self._drivers[tree_id] = driver
            self._failed.pop(tree_id, None)
        if self._leases.holds(tree_id):
            return True
        self._lease_lost(tree_id, driver)
        self._ensure_watcher()
        return False

    def _existing_start(self, tree_id: TreeID, started: TreeStarted) -> RunHandle:
        first = self.store.first_event(tree_id)
        if first is None:
            raise Rejected("engine.start.in_progress", f"start {started.start_id} is being created by another runtime",
                           hint="start it again in a moment: the same start id then returns that run")
        original = first.event
        if not isinstance(original, TreeStarted):
            raise CorruptStream(tree_id, 1, "stream.first_event",
                                f"the first event must be TreeStarted, got {type(original).__name__}")
        if original.program != started.program or digest_of(original.input) != digest_of(started.input):
            raise Rejected(
                "engine.start.conflict",
                f"start id {started.start_id} already started {original.program.name} with a different input or program",
                hint="use a new start id for a different run",
            )
        handle = RunHandle(self, tree_id, original.process_id, original.start_id)
        if tree_id not in self._drivers and self.adopt_on_admit:
            # Only when there is something to drive: a queue delivering a parked run's job again
            # appended a WriterActivated to its history at every delivery.
            self._try_adopt(tree_id, if_needed=True)
        return handle

    # -- ownership -----------------------------------------------------------

    def _try_adopt(
        self, tree_id: TreeID, *, new_only: bool = False, admission: _Admission | None = None,
        if_needed: bool = False,
    ) -> _Driver | None:
        """Take ownership of a tree nobody drives (``WriterActivated``); None if someone does
        (with ``new_only``, also when this runtime's own owner line already drives it; with
        ``if_needed``, also when, looked at under its lease, it needs no recovery: a parked
        run with nothing in flight, perhaps taken over and left by a racing ``recover``).

        Serialized per tree within this runtime: leases are re-entrant inside one process,
        so two threads adopting the same tree would both activate it, and the loser's
        failure would release the lease the winner holds.
        """
        with self._adopt_lock(tree_id):
            driver = self._drivers.get(tree_id)
            if driver is not None and driver.stopped is not None:
                # Its owner line stopped and is leaving (its ``_forget`` waits for this lock): it
                # leaves now, giving the lease back, and this adoption takes the lease anew
                # (handed on as it is, a lease lost but not yet noticed would go with it).
                self._forget(driver)
            with self._lock:
                driver = self._drivers.get(tree_id)
                if driver is not None:
                    return None if new_only else driver
                if self._closed or self._draining:
                    # Draining (a server stopping): it starts no call, so it takes no run over
                    # either (an activation makes a same_identity call again); input is recorded
                    # without driving it, and the run's next owner drives it.
                    return None
                if not self._leases.acquire(tree_id):
                    return None
            try:
                head = self.store.head(tree_id)
                if head is not None and head.classification == "terminal":
                    # A finished tree needs no writer: activating it would append to a closed history.
                    self._leases.release(tree_id)
                    return None
                if if_needed and head is not None and not self.needs_recovery(head):
                    self._leases.release(tree_id)
                    self._note_quiet(tree_id, head.version)
                    return None
                driver = self._activate(tree_id, admission)
                if driver is None:  # the request changed nothing: nothing was appended
                    self._leases.release(tree_id)
                return driver
            except BaseException:
                with self._lock:
                    owned = tree_id in self._drivers
                if not owned:
                    self._leases.release(tree_id)
                raise

    def _activate(self, tree_id: TreeID, admission: _Admission | None = None) -> _Driver | None:
        """Take the tree over (its lease is held here) and drive it; with an ``admission``, the
        request goes in the same append. None when the request changed nothing on a tree with
        nothing to decide or drive: a request sent again ("already paused", a steering resend
        under its signal id) appended a ``WriterActivated`` to a parked run every time."""
        loaded = self._load(tree_id)
        incarnation = self.ids.incarnation_id()
        base_incarnation = loaded.state.incarnation
        for _ in range(64):
            if loaded.state.classification() == "terminal":
                # Every Process ended (its index row was behind, or a writer ended it after that
                # row was read): there is nothing to drive, and no writer to activate.
                return None
            stored_version = loaded.state.version  # (the kernel folds what it decides into the state)
            driver = _Driver(self, tree_id, loaded, incarnation)
            with driver.lock:
                permits = _Permits(driver)
                kernel = Kernel(driver.tree, self._resolve, self.ids, dispatch=permits,
                                interruptible=_on_main_thread())
                admitted: list[TreeEvent] = []
                value: Any = None
                later = Progress()
                try:
                    activation = kernel.activate(incarnation)
                    if admission is not None and admission.terminal:
                        # Before the Steps: planned calls of an ending Process never start, an intent
                        # recorded by an owner that died is "already ..." (not a refusal of what the
                        # advance ended on its own), and a re-armed timer is stopped (``_launch``).
                        admitted, value = admission.fn(kernel)  # a refusal raises: nothing is appended
                        if not self._only_timers(driver.tree, [
                            d for d in activation.dispatches
                            if driver.tree.ending(driver.tree.processes[d.process_id]) is not None
                        ]):
                            # A call with an outside effect of a Process the request ends would be
                            # made again: the request is recorded first instead (``Runtime._admit``).
                            # Calls of Processes it does not end are made again either way.
                            permits.give_back(discard=True)
                            return None
                        progress = kernel.advance(MAX_EVENTS_PER_APPEND)
                    else:
                        progress = kernel.advance(MAX_EVENTS_PER_APPEND)
                        if admission is not None:
                            admitted, value = admission.fn(kernel)  # a refusal raises: nothing is appended
                            if admitted:
                                later = kernel.advance(MAX_EVENTS_PER_APPEND)
                except BaseException:
                    permits.give_back(discard=True)
                    raise
                if admission is not None and not admitted and _only_activation(activation, progress):
                    permits.give_back(discard=True)
                    admission.applied, admission.value = True, value
                    self._note_quiet(tree_id, stored_version)
                    return None
                driver.waiting_slot = permits.denied
                if admission is not None and admission.terminal:
                    events = [*activation.events, *admitted, *progress.events]
                else:
                    events = [*activation.events, *progress.events, *admitted, *later.events]
                try:
                    driver._append(events)
                except BaseException as exc:
                    permits.give_back(discard=True)
                    if not isinstance(exc, VersionConflict):
                        raise
                    loaded = self._load(tree_id)
                    if loaded.state.incarnation != base_incarnation:
                        if not self._activated_by_the_dead(tree_id, loaded.state.incarnation):
                            raise Fenced(
                                "engine.tree.incarnation_conflict",
                                f"tree {tree_id} was activated by another writer ({loaded.state.incarnation})",
                            ) from None
                        base_incarnation = loaded.state.incarnation
                    continue
                if admission is not None:  # recorded, whatever happens to this owner line now
                    admission.applied, admission.value = True, value
                if not self._register(driver):
                    permits.give_back(discard=True)
                    return driver
                driver._launch([*activation.dispatches, *progress.dispatches, *later.dispatches], permits)
                permits.give_back()
                driver._after_commit([], [])
                driver.more_to_do(later if later.events else progress)
            driver.start_jobs(keep_last=False)
            self._ensure_watcher()
            return driver
        raise RuntimeStopped("engine.tree.contention", f"tree {tree_id} kept changing during activation")

    def _only_timers(self, tree: TreeState, dispatches: Sequence[Dispatch]) -> bool:
        """Whether every call of ``dispatches`` (made again by an activation) is a timer
        (``waits_as_timer``): waiting for an instant again has no outside effect."""
        return all(self._waits_as_timer(tree.processes[d.process_id].program) for d in dispatches)

    def _note_quiet(self, tree_id: TreeID, version: int) -> None:
        """A tree found under this runtime's lease with nothing to drive, at ``version``."""
        with self._lock:
            self._quiet[tree_id] = version
            while len(self._quiet) > _RESULTS_KEPT:
                self._quiet.popitem(last=False)

    def _activated_by_the_dead(self, tree_id: TreeID, other: TreeIncarnationID | None) -> bool:
        """Whether an activation that committed under this runtime's activation while it held
        the tree's lease can only be a dead writer's, so that activating again on top of it
        is safe.

        An exclusive lease held here means no live runtime holds it: a writer that activated
        meanwhile lost its lease before its statement committed. On PostgreSQL that is a server
        killed while its takeover statement waited for the events table's lock: the server
        runs the statement to its commit after the client's death (nothing reads the dead
        socket while it waits). Fencing this runtime then left the run to a dead owner (its
        request answered ``409 engine.tree.incarnation_conflict`` until the orphan scan
        adopted the run again). A writer that still runs is fenced by our activation as it
        would have been had ours come first. Without an exclusive lease (a lease-less test
        double) two live writers race: the version fence decides, and the loser stops.
        """
        if not getattr(self._leases, "exclusive", False) or not self._leases.holds(tree_id):
            return False
        log.warning(
            "tree %s: incarnation %s activated it while this runtime held its lease (a writer that died while "
            "its statement waited); activating it again", tree_id, other,
        )
        return True

    def recover(self, tree: str | None = None, *, if_needed: bool = False) -> list[RunHandle]:
        """Take ownership of one tree, or of every live tree nobody owns, and drive them.

        Nothing is called again: in-flight Effects are re-dispatched only under a
        ``same_identity`` policy, otherwise they settle unknown.

        Of every live tree (``tree`` None): a parked tree with nothing in flight is left
        as it is (``needs_recovery``: adopting it would only append a ``WriterActivated``
        to its history at every worker start; the runtime that admits input for it, or an
        orphan scan, takes it up); a tree this runtime cannot take (its Program is not
        bound here or cannot be rebuilt, its history is corrupt) is left alone, logged and
        listed in ``recover_failures`` (tree id -> the error), so that one such run does
        not stop a worker from taking up the others; a failing store still raises. One
        tree: it is taken whatever its state (with ``if_needed``, only when it needs recovery
        once its lease is held: none is returned for a parked tree with nothing in flight),
        and its error is raised.
        """
        self._check_open()
        if tree is not None:
            tree_ids = [self.tree_of(tree)]
        else:
            tree_ids = [TreeID(h.tree_id) for h in self.store.heads(live_only=True) if self.needs_recovery(h)]
            self.recover_failures = {}
        handles = []
        for tree_id in tree_ids:
            head = self.store.head(tree_id)
            if head is not None and head.classification == "terminal":
                # Nothing to drive; its result is in the store.
                handles.append(RunHandle(self, tree_id, ProcessID(head.root_process_id), StartID(head.start_id)))
                continue
            try:
                # Every live tree: judged again under its lease (two `recover` commands racing each
                # appended an activation to a run the first had already taken over and parked).
                driver = self._try_adopt(tree_id, if_needed=if_needed or tree is None)
            except Exception as exc:
                if tree is not None or _store_down(exc):
                    raise
                failure = exc if isinstance(exc, AgentfoldError) else AgentfoldError(
                    "engine.program.unavailable", f"rebuilding the Program of tree {tree_id} failed: "
                    f"{type(exc).__name__}: {recorded_text(exc)}", hint="fix the loader, or bind the exact Program this tree runs")
                log.warning("recover: tree %s left alone: %s", tree_id, failure)
                self.recover_failures[tree_id] = failure
                continue
            if driver is None:
                if if_needed and tree is not None and not self._draining:
                    now = self.store.head(tree_id)
                    if now is None or not self.needs_recovery(now):
                        continue  # it needs no recovery (now: a racing `recover` took it over and parked it)
                if tree is not None and self._draining:
                    raise RuntimeStopped(
                        "engine.runtime.draining", f"tree {tree_id} was not taken over: this runtime is draining",
                        hint="a draining runtime (drain, a stopping server) takes no run over; "
                        "recover it with another runtime",
                    )
                if tree is not None:
                    ended = self.store.load(tree_id).state  # the kernel's fold: no Program needs binding
                    if ended.classification() == "terminal":
                        # Ended, though its index row said otherwise (``_activate``): as above.
                        handles.append(RunHandle(self, tree_id, ended.root.process_id, ended.start_id))  # type: ignore[arg-type]
                        continue
                    raise Fenced(
                        "engine.tree.owned", f"tree {tree_id} is owned by another live runtime",
                        hint="that runtime drives it; send input instead, or stop it first",
                    )
                continue
            self.recovered += 1
            handles.append(RunHandle(self, tree_id, driver.tree.root.process_id, driver.tree.start_id))  # type: ignore[arg-type]
        return handles

    def needs_recovery(self, head: TreeHead) -> bool:
        """Whether adopting the tree of this index row would change anything.

        A parked tree (every live Process waiting, paused or stopped by an unknown
        outcome) with no dispatch committed but unsettled has nothing to decide and
        nothing to drive: adopting it would only append a ``WriterActivated``, so a
        periodic ``recover`` would grow every parked history. It is adopted when input
        reaches it. Anything else (progress, an Effect in flight, a tree that cannot be
        loaded, so that adopting reports why) needs recovery, and so does a row an earlier
        release stored as parked that the fold now says is not (a cancel, kill or deadline
        recorded on a waiting run, which no owner carried out before that release changed
        the rule: such a run was left waiting for good).
        """
        if head.classification == "terminal":
            return False
        if head.classification != "parked":
            return True
        try:
            tree = self._load(TreeID(head.tree_id)).state
        except AgentfoldError as exc:
            if exc.code != "engine.program.unavailable":
                return True
            # Its Program is not bound here: the kernel's fold (no Program) still says whether a
            # call is in flight. With none, nothing is left to do here either, and a periodic
            # `recover` of a worker that binds other Programs must not fail for it.
            try:
                tree = self.store.load(TreeID(head.tree_id)).state
            except AgentfoldError:
                return True
        return tree.classification() != "parked" or any(process.in_flight() for process in tree.live.values())

    def owns(self, tree_id: TreeID) -> bool:
        with self._lock:
            return tree_id in self._drivers

    def drives(self, tree_id: TreeID) -> bool:
        """Whether this runtime drives the tree on (it owns it), drove it to its end, or found
        it under its lease with nothing to drive (a request that changed nothing, and nobody
        appended since): false when another runtime owns it (or ended it: a request recorded
        beside a live owner waits a moment for a holder passing through, and a quick run may
        end meanwhile)."""
        with self._lock:  # released at its end and kept among the results at once
            if tree_id in self._drivers or tree_id in self._results:
                return True
            quiet = self._quiet.get(tree_id)
        if quiet is None:
            return False
        head = self.store.head(tree_id)
        return head is not None and head.version == quiet

    def release(self, tree: TreeID | str) -> None:
        """Stop driving a tree (its state stays in the store; another runtime may adopt it).
        ``tree``: a TreeID, or a tree id, start id or process id in text."""
        tree_id = self._tree_ref(tree)  # None or a number: identity.invalid, not a silent no-op
        with self._lock:
            driver = self._drivers.get(tree_id)
        if driver is not None:
            # Its owner line leaves and gives the lease back (``_forget``, under the adoption lock).
            driver._stop(RuntimeStopped("engine.runtime.released", f"tree {tree_id} was released by its owner"))
            return
        with self._adopt_lock(tree_id):
            with self._lock:
                if tree_id in self._drivers:
                    return  # taken again meanwhile: the lease is that owner line's
            self._leases.release(tree_id)

    def _adopt_lock(self, tree_id: TreeID) -> threading.RLock:
        """The lock under which this runtime takes a tree (``_try_adopt``, a start, a look
        under its lease) and gives it up (``_forget``): this runtime's leases are re-entrant,
        so a tree taken between an owner line's leaving and its lease's release would get
        the lease that is about to be given back."""
        return self._adopt_locks[hash(tree_id) % len(self._adopt_locks)]

    @contextlib.contextmanager
    def _lease_look(self, tree_id: TreeID) -> Iterator[_LeaseLook]:
        """The owner lease of a tree nobody drives here, taken for a look at its stored state
        and given back at the end (unless ``keep``), under the tree's adoption lock (no
        adoption here shares it). ``held`` says whether it was taken (``"look"``), or why
        not: ``"here"`` (an owner line of this runtime drives the tree, the lease is held here
        without one, or this runtime is closed: never given back by a look) or
        ``"elsewhere"`` (another runtime holds it). Meanwhile another writer finds the tree
        owned: input it admits is recorded without being driven."""
        with self._adopt_lock(tree_id):
            with self._lock:
                here = tree_id in self._drivers or self._closed or self._leases.holds(tree_id)
            if here:
                yield _LeaseLook("here")
                return
            if not self._leases.acquire(tree_id):
                yield _LeaseLook("elsewhere")
                return
            look = _LeaseLook("look")
            try:
                yield look
            finally:
                if not look.kept:
                    self._leases.release(tree_id)

    def _forget(self, driver: _Driver) -> None:
        self._slots.give_back_reserved(driver, leave=True)
        # Under the tree's adoption lock: a thread of this runtime taking the tree meanwhile
        # waits for the lease to be given back, then takes it anew (it would otherwise be
        # handed this lease, re-entrant, and drive the tree without one once it is released).
        with self._adopt_lock(driver.tree_id):
            with self._lock:
                current = self._drivers.get(driver.tree_id)
                if current is driver:
                    del self._drivers[driver.tree_id]
                if driver.final is not None and driver.stopped is None:
                    self._results[driver.tree_id] = driver.final
                    while len(self._results) > _RESULTS_KEPT:
                        self._results.popitem(last=False)
            if current is None or current is driver:
                # Not while another owner line of this runtime drives the tree: the lease (re-entrant
                # within this runtime) is that line's now.
                self._leases.release(driver.tree_id)

    # -- admission -----------------------------------------------------------

    def _admit(
        self, tree_id: TreeID, fn: Callable[[Kernel], tuple[list[TreeEvent], Any]], *, record_first: bool = False
    ) -> Any:
        """Apply a host's request: through this runtime's owner line when it drives the tree,
        else on the tree as this runtime would take it over (then driven here), else recorded
        on the tree as stored (its live owner applies it).

        ``record_first`` (a terminal intent: cancel, kill, deadline): a tree nobody drives is
        taken over only after the request is recorded, so that the takeover reads the intent
        and makes no ``same_identity`` call again for a run being ended (scope-kernel.md §3.8);
        taken over first, the call was made again before the cancel was applied."""
        self._check_open()
        driver = self._drivers.get(tree_id)
        if driver is not None and driver.stopped is not None:
            driver = None  # an owner line that is leaving: the tree is taken anew (``_try_adopt``)
        if driver is None and self.adopt_on_admit:
            # Taken over and applied in ONE append (the activation, what it decides, the request
            # and the Steps it allows), on the tree as the new owner sees it: a request refused
            # there appends nothing, not even the activation. Taken over first and refused after
            # (another host's input landed in between), a command committed the takeover and the
            # next call's permission, then exited and left that call unknown. A terminal request
            # is applied right after the activation, and only when every call the activation
            # makes again for a Process the request ends is a timer (``_Admission.terminal``);
            # else it is recorded first (below).
            admission = _Admission(fn, terminal=record_first)
            driver = self._try_adopt(tree_id, admission=admission)
            if admission.applied:
                return admission.value
            # None: another live runtime owns the tree (its owner applies what is recorded below,
            # validated on the tree as stored, as that owner sees it), or it has ended.
        if driver is not None:
            return driver.call(fn)
        for _ in range(64):
            loaded = self._load(tree_id)
            kernel = Kernel(loaded.state, self._resolve, self.ids)
            base = loaded.state.version
            events, value = fn(kernel)
            if not events and not (record_first and driver is None and self.adopt_on_admit):
                return value
            if events:
                try:
                    now = self.clock()
                    self.store.append(
                        tree_id, base, events, previous_digest=loaded.digest, timestamp=now,
                        head=index_head(loaded.state, tree_id, events, now),
                    )
                except VersionConflict:
                    continue
                self._counts["remote_admissions"] += 1
            # (An intent recorded already, by a host that does not drive or an owner that died
            # before carrying it out: this one takes the run over to carry it out, as below.)
            if driver is None and self.adopt_on_admit:
                self._take_over_recorded(tree_id, base + len(events))
            return value
        raise RuntimeStopped("engine.tree.contention", f"tree {tree_id} kept changing; try again")

    def _take_over_recorded(self, tree_id: TreeID, recorded: int) -> None:
        """Drive a tree on which this runtime recorded input as stored (its lease was held).

        The holder was its live owner (whose watcher catches up with this input), or one only
        passing through: an orphan scan or ``recover`` looking whether the parked tree needed
        driving, or a racing request whose own takeover was refused (the input recorded here
        made it moot). Then nobody drives this input (the CLI said "another runtime drives it"
        while none did): the tree is tried again, at once, then after TAKE_OVER_PAUSES here
        (no watcher) or at the watcher's polls, until an owner appends after ``recorded`` (the
        version the input made: a live owner took it up; more input from other hosts does not
        tell). The input is recorded whatever happens here: a failure leaves the tree to
        ``recover`` or a server's orphan scan.
        """
        if self._take_over_once(tree_id, recorded):
            return
        if self.poll_interval > 0:
            now = time.monotonic()
            with self._lock:
                if not self._closed:
                    self._left[tree_id] = (now + self.poll_interval, self.poll_interval, now + TAKE_OVER_SECONDS,
                                           recorded)
            self._ensure_watcher()
            return
        for pause in TAKE_OVER_PAUSES:
            time.sleep(pause)
            if self._take_over_once(tree_id, recorded):
                return

    def _take_over_once(self, tree_id: TreeID, recorded: int) -> bool:
        """One try of ``_take_over_recorded``: True when nothing is left to try (the tree is
        driven here, ended, parked with nothing to drive, appended to after ``recorded``, this
        runtime is closing, or taking it failed), False when its lease is still held elsewhere."""
        try:
            # Only when it needs driving: input that left the tree parked (steering for a run
            # waiting for its human) needs no owner, and a takeover would only add an activation.
            if self._try_adopt(tree_id, new_only=True, if_needed=True) is not None or self.owns(tree_id):
                return True
            if self._closed or self._draining:
                return True
            head = self.store.head(tree_id)
            if head is None:
                return True
            if head.version > recorded and any(
                not isinstance(stored.event, _INPUT_EVENTS) for stored in self.store.read(tree_id, after=recorded, verify=False)
            ):
                return True  # an owner acted after this input (other hosts' input alone does not tell)
            return not self.needs_recovery(head)
        except Exception as exc:  # noqa: BLE001 - never report a recorded input as failed
            log.warning("tree %s: input recorded, but taking the tree to drive it failed: %s", tree_id, exc)
            return True

    def _take_over_left(self) -> None:
        """The watcher's tries of ``_take_over_recorded``, for the trees whose pause is over."""
        now = time.monotonic()
        with self._lock:
            due = [(tree_id, entry) for tree_id, entry in self._left.items() if entry[0] <= now]
        for tree_id, entry in due:
            if self._closed:
                return
            _, pause, until, recorded = entry
            done = self._take_over_once(tree_id, recorded) or time.monotonic() >= until
            with self._lock:
                if self._left.get(tree_id) is not entry:
                    continue  # input recorded here again meanwhile: its own entry stands
                if done:
                    del self._left[tree_id]
                else:  # the last try at ``until`` at the latest
                    self._left[tree_id] = (min(time.monotonic() + pause * 2, until), pause * 2, until, recorded)

    def deliver_signals(self, process_id: ProcessID | str, requests: Sequence[SignalRequest]) -> bool:
        """Admit signals to a Process, all or nothing; False when all were already admitted."""
        if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, Sequence) or not all(
            isinstance(r, SignalRequest) for r in requests
        ):
            raise InvalidInput(
                "signal.invalid", f"signals must be a list of SignalRequest, not {brief_repr(requests)}",
                hint='pass [SignalRequest("signal-id", payload)] (agentfold.domain.program.SignalRequest)',
            )
        pid = ProcessID(process_id)
        tree_id = self.tree_of_process(pid)

        def admit(kernel: Kernel) -> tuple[list[TreeEvent], Any]:
            events = kernel.admit_signals(pid, requests)
            return events, bool(events)

        return bool(self._admit(tree_id, admit))

    def _control(self, process_id: ProcessID | str, control: str, reason: str | None) -> bool:
        pid = ProcessID(process_id)
        tree_id = self.tree_of_process(pid)

        def request(kernel: Kernel) -> tuple[list[TreeEvent], Any]:
            events = kernel.request_control(pid, control, reason)
            return events, bool(events)

        return bool(self._admit(tree_id, request, record_first=control in ("cancel", "kill", "deadline")))

    def pause(self, process_id: ProcessID | str, reason: str = "paused by host") -> bool:
        return self._control(process_id, "pause", reason)

    def resume(self, process_id: ProcessID | str) -> bool:
        return self._control(process_id, "resume", None)

    def cancel(self, process_id: ProcessID | str, reason: str = "canceled by host") -> bool:
        return self._control(process_id, "cancel", reason)

    def kill(self, process_id: ProcessID | str, reason: str = "killed by host") -> bool:
        return self._control(process_id, "kill", reason)

    def deadline(self, process_id: ProcessID | str, reason: str = "deadline reached") -> bool:
        return self._control(process_id, "deadline", reason)

    def resolve_unknown_effect(
        self, effect_id: EffectID | str, settlement: Settlement, *, process_id: ProcessID | str | None = None
    ) -> None:
        """Settle an unknown Effect with the definite outcome a host established."""
        eid = parse_effect_id(effect_id)
        if (
            not isinstance(settlement, Settlement)
            or not isinstance(settlement.status, SettlementStatus)  # Settlement("succeeded", ...) built by hand
            or not settlement.status.definite
        ):
            raise InvalidInput("engine.effect.settlement_invalid", "a resolution must be a succeeded or failed Settlement",
                               hint="build it with Settlement.succeeded(payload) or Settlement.failed(payload)")
        self._not_replaying(eid)
        tree_id = self._tree_of_effect(eid, process_id)
        pid = ProcessID(process_id) if process_id is not None else None

        def resolve(kernel: Kernel) -> tuple[list[TreeEvent], Any]:
            return kernel.resolve_effect(eid, settlement.status, settlement.payload, process_id=pid), None

        self._admit(tree_id, resolve)

    def _not_replaying(self, eid: EffectID) -> None:
        with self._lock:
            if eid in self._replaying:
                raise Rejected("engine.effect.not_pending", f"a replay of effect {eid} is in flight",
                               hint="wait for the replay's outcome")

    def _tree_of_effect(self, eid: EffectID, process_id: ProcessID | str | None) -> TreeID:
        if process_id is not None:
            return self.tree_of_process(ProcessID(process_id))
        found = self.store.tree_of_unknown_effect(eid)
        if found is None:
            raise NotFound(
                "engine.effect.not_pending", f"effect {eid} is not an unknown effect of any tree",
                hint="list unknown effects with `agentfold unknown`",
            )
        return found

    def replay_unknown_effect(self, effect_id: EffectID | str, *, process_id: ProcessID | str | None = None) -> Settlement:
        """Dispatch an unknown Effect again under its EffectID (only with ``same_identity``).

        A definite outcome resolves it; an uncertain one raises
        ``engine.effect.outcome_unknown`` and leaves it unknown.
        """
        eid = parse_effect_id(effect_id)
        with self._lock:
            self._not_replaying(eid)
            self._replaying.add(eid)
        try:
            return self._replay(eid, process_id)
        finally:
            with self._lock:
                self._replaying.discard(eid)

    def _replay(self, eid: EffectID, process_id: ProcessID | str | None) -> Settlement:
        tree_id = self._tree_of_effect(eid, process_id)
        loaded = self._load(tree_id)
        found = loaded.state.find_effect(eid)
        if found is None or not found[1].unknown or found[1].resolved_by is not None:
            raise Rejected("engine.effect.not_pending", f"effect {eid} is not an unknown effect (any more)",
                           hint="list unknown effects with Host.unknown() or `agentfold unknown`")
        process, record = found
        ending = None if process.terminal else loaded.state.ending(process)
        if process.terminal or ending is not None:
            raise Rejected("engine.process.finished", f"process {process.process_id} is finished or finishing"
                           + (f" ({ending})" if ending else ""),
                           hint="nothing to replay: the run's outcome no longer depends on this effect")
        program = self._resolve(process.program)
        if record.target != "dispatcher" or record.replay != "same_identity":
            raise Rejected(
                "engine.effect.replay_forbidden",
                f"effect {eid} has replay policy {record.replay!r}; only same_identity effects may be replayed",
                hint="investigate the outcome and resolve it instead",
            )
        if not replay_allowed(program, record):
            raise Rejected(
                "engine.effect.replay_forbidden",
                f"effect {eid} was declared same_identity, but its Program "
                + ("is not bound here" if program is None else "does not say same_identity for it now")
                + ": it is not dispatched again",
                hint="investigate the outcome and resolve it instead",
            )
        attempt = self.ids.attempt_id()
        request = effect_request(loaded.state, process.process_id, eid, program, attempt)
        dispatch = Dispatch(process.process_id, eid, attempt)
        dispatcher = program.dispatcher if program is not None else None
        try:
            if dispatcher is None:
                raise RuntimeError("no dispatcher is bound")
            done = _settled(dispatch, dispatcher.dispatch(request, DispatchContext()))
        except Exception as exc:  # noqa: BLE001
            done = _unknown(dispatch, EngineCode.DISPATCH_FAILED, f"{type(exc).__name__}: {recorded_text(exc)}")
        self.calls_settled.add(done.status.value)  # a replay is a call too (GET /metrics)
        if not done.status.definite:
            raise Rejected(
                "engine.effect.outcome_unknown",
                f"the replay of {eid} did not establish an outcome: {done.diagnostic}",
                hint="the effect stays unknown; investigate and resolve it",
            )
        settlement = Settlement(done.status, done.payload)

        def resolve(kernel: Kernel) -> tuple[list[TreeEvent], Any]:
            return kernel.resolve_effect(
                eid, settlement.status, settlement.payload, resolved_by="replay", attempt_id=attempt
            ), None

        self._admit(tree_id, resolve)
        return settlement

    # -- observation ---------------------------------------------------------

    def capture(self, tree: str | TreeID) -> TreeState:
        """The committed folded tree (a private copy for an owned tree)."""
        tree_id = self._tree_ref(tree)
        driver = self._drivers.get(tree_id)
        if driver is not None:
            with driver.lock:
                if driver.stopped is None:  # else its tree may hold events no append acknowledged
                    copy = _copy_of(driver)
                    if copy is not None:
                        return copy
        return self._load(tree_id).state

    def _tree_ref(self, tree: TreeID | str) -> TreeID:
        """A tree id as given, or the tree of a tree id, start id or process id in text."""
        return tree if isinstance(tree, TreeID) else self.tree_of(tree)

    def status(self, tree: TreeID | str) -> str:
        tree_id = self._tree_ref(tree)
        head = self.store.head(tree_id)
        if head is None:
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
        return head.status

    def result(self, tree: TreeID | str, timeout: float | None = None) -> Result:
        """Wait for the root Process to be terminal; return its Result.

        ``tree``: a TreeID, or a tree id, start id or process id in text. A run this runtime
        does not drive is waited for in the store (another runtime drives it). Once this
        runtime is closed, a run that has not finished is ``engine.runtime.closed``."""
        _seconds_argument(timeout, "result's timeout", none=True)
        tree_id = self._tree_ref(tree)
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        while True:
            driver = self._drivers.get(tree_id)
            if driver is not None:
                # Bounded even while the owner line holds the lock inside a blocked store call.
                if not driver.cond.acquire(timeout=-1 if deadline is None else remaining()):  # type: ignore[arg-type]
                    raise TimeoutError(f"tree {tree_id} is not finished")
                try:
                    def ended(line: _Driver = driver) -> bool:
                        return line.final is not None or line.stopped is not None

                    driver.cond.wait_for(ended, remaining())
                    # Only an acknowledged termination is published, never the folded tree's.
                    if driver.final is not None:
                        return driver.final
                    if driver.stopped is not None:
                        raise driver.stopped.again()
                    raise TimeoutError(f"tree {tree_id} is not finished")
                finally:
                    driver.cond.release()
            failed = self._failed.get(tree_id)
            if failed is not None:
                raise failed.again()
            kept = self._results.get(tree_id)
            if kept is not None:
                return kept
            head = self.store.head(tree_id)
            if head is not None and head.status in TERMINAL:
                return Result.of(self.store.load(tree_id).state.root)
            if head is None and tree_id not in self._drivers:  # else it waited for a run nobody starts
                raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
            if self._closed:  # else it waited for good: nothing here drives the run any more
                raise RuntimeStopped("engine.runtime.closed", f"this runtime is closed; tree {tree_id} is not finished",
                                     hint="wait for the run from a runtime that is open")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"tree {tree_id} is not finished")
            time.sleep(0.05)

    def wait_idle(self, tree: TreeID | str, timeout: float = 30.0, *, elsewhere: bool = True,
                  past_timers: bool = False, horizon: float | None = None) -> TreeState:
        """Wait until the tree has nothing left to do now; its folded state.

        The tree is then terminal or parked (waiting for input, paused, or blocked on
        an unknown Effect), with no dispatch in flight. ``tree``: a TreeID, or a tree id,
        start id or process id in text. A tree this runtime does not drive is waited for in
        the store (another runtime drives it; a tree nobody drives ends in TimeoutError);
        with ``elsewhere=False`` its stored state is returned at once (the CLI and the HTTP
        API answer a run another process owns as stored).

        ``past_timers``: a tree whose only calls under way are timers due after ``timeout``
        that the next owner makes again (replay policy ``same_identity``, a Deadline's) is
        returned at once, its timers still in flight: nothing happens before their instants
        (``waiting_timers`` says when). For an owner that stops waiting at ``timeout``, or at
        ``horizon`` (a ``time.monotonic()`` instant) when it waits in slices of ``timeout``: the
        timers due before the horizon are then waited for, slice after slice.
        """
        _seconds_argument(timeout, "wait_idle's timeout")
        if horizon is not None and not _is_seconds(horizon, negative=True):
            raise InvalidInput("runtime.invalid", f"wait_idle's horizon is a time.monotonic() instant, not "
                               f"{brief_repr(horizon)}", hint="pass time.monotonic() + seconds, or None")
        tree_id = self._tree_ref(tree)
        deadline = time.monotonic() + timeout
        driver = self._drivers.get(tree_id) or self._taken_over_for_input(tree_id, deadline)
        if driver is None:
            return self._stored_when_idle(tree_id, deadline, elsewhere)
        # Bounded even while the owner line holds the lock inside a blocked store call.
        if not driver.cond.acquire(timeout=timeout):
            raise TimeoutError(f"tree {tree_id} is still busy")
        try:
            while True:
                if driver.stopped is not None:
                    failed = self._failed.get(tree_id)
                    if failed is not None:
                        raise failed.again()
                    break  # closed or released meanwhile: the store answers (below)
                quiet = driver.idle and not driver.flights and not driver._scheduled
                now = time.monotonic()
                remaining = deadline - now
                far = (horizon if horizon is not None else deadline) - now
                if quiet or (past_timers and not driver.waiting_slot and driver.far_timers(far)):
                    copy = _copy_of(driver)
                    if copy is not None:
                        return copy
                    break  # its Program's state does not copy: the store answers (below)
                if remaining <= 0:
                    raise TimeoutError(f"tree {tree_id} is still busy")
                driver.cond.wait(min(remaining, 0.05))
        finally:
            driver.cond.release()
        return self._stored_when_idle(tree_id, deadline, elsewhere)

    def taking_over(self, tree_id: TreeID) -> bool:
        """Whether this runtime still tries to take the tree over for input it recorded beside
        another runtime's lease (``_take_over_recorded``, at the watcher's polls)."""
        with self._lock:
            return tree_id in self._left

    def _taken_over_for_input(self, tree_id: TreeID, deadline: float) -> _Driver | None:
        """The tree's owner line here, once the watcher's tries to take it over for input this
        runtime recorded beside another's lease (``_take_over_recorded``) succeed; None when they
        end without it (a live owner took the input up) or at ``deadline``. A wait for the run
        (an HTTP write's ``wait``) answered at once with the input undriven, although this
        runtime took the run over a poll later and drove it."""
        while True:
            driver = self._drivers.get(tree_id)
            if driver is not None:
                return driver
            left = deadline - time.monotonic()
            if not self.taking_over(tree_id) or left <= 0:
                return None
            time.sleep(min(0.01, left))

    def _stored_when_idle(self, tree_id: TreeID, deadline: float, elsewhere: bool) -> TreeState:
        """``wait_idle`` for a tree without an owner line here: its stored state, read every
        0.05 s, once it is terminal, or parked with no dispatcher call in flight (at once
        without ``elsewhere``)."""
        while True:
            failed = self._failed.get(tree_id)
            if failed is not None:
                raise failed.again()
            if not elsewhere:
                return self._load(tree_id).state
            head = self.store.head(tree_id)
            if head is None:
                raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")
            if head.classification in ("terminal", "parked"):
                state = self._load(tree_id).state
                calls = (r for p in state.live.values() for r in p.in_flight() if r.target == Target.DISPATCHER)
                if head.classification == "terminal" or next(calls, None) is None:
                    return state
            if tree_id in self._drivers and not self._closed:  # adopted here meanwhile (input admitted here)
                return self.wait_idle(tree_id, max(0.0, deadline - time.monotonic()))
            if self._closed:
                raise RuntimeStopped("engine.runtime.closed", f"this runtime is closed; tree {tree_id} is still busy",
                                     hint="wait for the run from a runtime that is open")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"tree {tree_id} is still busy (driven by another runtime, or by none)")
            time.sleep(0.05)

    # -- crash plans ---------------------------------------------------------

    def _crash_check(self, events: list[TreeEvent]) -> tuple[list[TreeEvent], bool]:
        """Apply the crash plan to one append: maybe cut it, and say whether to exit after it."""
        plan = self.crash
        assert plan is not None
        counts = self._counts
        for event in events:
            if isinstance(event, EffectDeclared) and event.target == "dispatcher":
                counts["dispatcher"] += 1
                self._ordinal[event.effect_id] = counts["dispatcher"]
        if plan.kind in ("after", "before"):
            hit = False
            for event in events:
                key = "type:" + type(event).__name__
                counts[key] += 1
                if type(event).__name__ == plan.event_type and counts[key] == plan.n:
                    hit = True
            if hit and plan.kind == "before":
                plan.exit()
            return events, hit
        for index, event in enumerate(events):
            eid = getattr(event, "effect_id", None)
            if eid is None or self._ordinal.get(eid) != plan.n:
                continue
            if plan.kind == "declared" and isinstance(event, EffectDeclared):
                for later in range(index + 1, len(events)):
                    other = events[later]
                    if isinstance(other, EffectDispatched) and other.effect_id == event.effect_id:
                        return events[:later], True
                return events, True
            if plan.kind == "dispatched" and isinstance(event, EffectDispatched):
                return events, True
            if plan.kind == "settled" and isinstance(event, EffectSettled):
                return events, True
        return events, False

    # -- watching other writers ----------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is not None or self.poll_interval <= 0:
            return
        with self._watcher_lock:  # two first starts at once: one watcher
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._watch, name="agentfold-watch", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Notice appends other writers made to trees this runtime owns (input admitted elsewhere).

        One query per poll reads the owned trees' versions from the tree index; a tree
        whose stored version is ahead of its owner's is caught up by its owner.
        """
        quiet_stop_signals()
        while not self._watch_stop.wait(self.poll_interval):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the watcher must survive transient store errors
                continue

    def _poll(self) -> None:
        """One look of the watcher. A method of its own, not the loop's body: what a look
        names (an owner line, and through it its tree and Programs) is let go when it ends,
        not kept by the watcher's frame until the next look that finds a tree behind (a run
        that finished after input admitted elsewhere stayed in memory)."""
        self._check_leases()
        self._adopt_lost()
        self._take_over_left()
        if self.adopt_orphans_every > 0 and time.monotonic() >= self._next_orphan_scan:
            self._next_orphan_scan = time.monotonic() + self.adopt_orphans_every
            self.adopt_orphans(budget=ORPHAN_SCAN_SECONDS)
        with self._lock:
            owned = {tree_id: driver.committed for tree_id, driver in self._drivers.items()}
        if not owned:
            return
        versions = self.store.versions(list(owned))
        for tree_id, version in versions.items():
            if version > owned[tree_id]:
                driver = self._drivers.get(tree_id)
                if driver is not None and version > driver.committed:
                    driver.submit(_Refresh())

    def _check_leases(self) -> None:
        """Stop the owner line of every tree whose lease the lease manager lost (e.g. its
        PostgreSQL session ended): another runtime may adopt the tree from now on."""
        for tree_id in self._leases.check():
            with self._lock:
                driver = self._drivers.get(tree_id)
            self._lease_lost(tree_id, driver)

    def _lease_lost(self, tree_id: TreeID, driver: _Driver | None) -> None:
        """Stop the owner line of a tree whose lease was lost, and note the tree to adopt again.

        Also without an owner line: a lease lost while its tree was being activated (the
        activation then finds its lease gone and stops), or held by no line at all (adopting
        again looks at the tree first: a finished or parked tree is left alone)."""
        if driver is None:
            with self._lock:
                failed = self._failed.get(tree_id)
            if isinstance(failed, Fenced) and failed.code == "engine.tree.incarnation_conflict":
                # Its owner line was fenced already: another runtime activated the tree (it learnt
                # so from the store before this session's probe failed). Nothing to adopt again.
                log.info("tree %s: not adopted again after its lease was lost: another runtime took it over", tree_id)
                return
        if driver is not None:
            driver._stop(
                Fenced(
                    "engine.tree.lease_lost",
                    f"the owner lease of tree {tree_id} was lost (its store session ended); "
                    "this runtime stops driving it",
                    hint="the tree continues wherever it is adopted next (`agentfold recover`)",
                )
            )
            log.warning("tree %s: owner lease lost; its owner line stopped", tree_id)
        with self._lock:
            if not self._closed:
                self._lost.setdefault(tree_id, 0)
                # Stopped: nothing more is appended by it. The latest of this runtime's lines counts:
                # a line that re-adopted the tree and lost its lease too appended an activation
                # after the first line's end, and that activation is ours, not a peer's take-over.
                noted = self._lost_line.get(tree_id)
                if driver is not None and (noted is None or driver.committed > noted[1]):
                    self._lost_line[tree_id] = (driver.incarnation, driver.committed, driver.digest)

    def _stalled(self, tree_id: TreeID, failure: StoreFailure) -> None:
        """Note a tree whose owner line a failed append stopped, to adopt it again (only a
        runtime with a watcher adopts again; a short-lived one reports the failure and ends)."""
        if self.poll_interval <= 0:
            return
        with self._lock:
            if not self._closed:
                self._lost.setdefault(tree_id, 0)
                self._stalled_trees.add(tree_id)
                self.last_stall = failure.again()  # kept: without the frames that raised it
        log.warning("tree %s: an append failed; its owner line stopped (adopted again when the store takes "
                    "appends)", tree_id)

    def stalled_trees(self) -> list[TreeID]:
        """Trees a failed append stopped that this runtime has not adopted again yet."""
        with self._lock:
            return sorted(self._stalled_trees)

    def _adopt_lost(self) -> None:
        """Drive again, under a new lease, the trees a lost lease session stopped.

        Once the lease manager works again (a new session), each such tree is adopted as
        ``recover`` would: ``WriterActivated``, then its in-flight Effects are decided as
        after a crash (a call that was under way settles unknown unless its policy allows a
        replay: its late outcome reaches only the stopped owner line and is never appended).
        A tree that finished or parked with nothing in flight is left alone; one whose lease
        someone else holds, or while the store fails, is tried again at the next polls (for
        ``LOST_TREE_ATTEMPTS`` polls: another runtime may own it for good).
        """
        with self._lock:
            if not self._lost:
                return
            lost = sorted(self._lost)
        if self._closed or self._draining or not self._leases.healthy():
            return
        for tree_id in lost:
            if self._closed:
                return
            with self._lock:
                already = self._drivers.get(tree_id)  # input admitted here adopted it meanwhile
            driver = None
            failure: Exception | None = None
            retry = False
            try:
                head = self.store.head(tree_id) if already is None else None
                if head is not None and self.needs_recovery(head):
                    driver = self._try_adopt(tree_id)
                    # None: its lease is held elsewhere: another runtime's, or still the ended
                    # session's (the server releases it when that backend has exited, a moment
                    # later). Stopped: the new session ended too, during the adoption.
                    retry = driver is None or driver.stopped is not None
                    if driver is None and self._taken_over(tree_id):
                        # Another runtime activated it since: it is that runtime's now. Trying
                        # again at every poll for LOST_TREE_ATTEMPTS polls cost two queries per
                        # tree per poll, for every run a peer took over after a failover.
                        retry = False
                        log.info("tree %s: not adopted again after its lease was lost: another runtime "
                                 "took it over", tree_id)
            except Exception as exc:  # noqa: BLE001 - one tree must not keep the others stopped
                failure = exc
                # The store is not back yet: try again at the next poll; go on with the others now.
                retry = _store_down(exc)
            if retry or failure is not None:
                with self._lock:
                    attempts = self._lost[tree_id] = self._lost.get(tree_id, 0) + 1
                    limit = STALLED_TREE_ATTEMPTS if tree_id in self._stalled_trees else LOST_TREE_ATTEMPTS
                if retry and attempts < limit:
                    if failure is not None:
                        log.debug("tree %s: not adopted again yet: %s", tree_id, failure)
                    continue
                if failure is not None:
                    log.warning("tree %s: cannot be adopted again after its lease was lost (`agentfold recover` "
                                "adopts it once the store works): %s", tree_id, failure)
                else:
                    log.info("tree %s: not adopted again after its lease was lost: another owner holds it", tree_id)
            with self._lock:
                self._lost.pop(tree_id, None)
                self._lost_line.pop(tree_id, None)
                stalled = tree_id in self._stalled_trees
                self._stalled_trees.discard(tree_id)
            if driver is not None and driver is not already and driver.stopped is None:
                log.warning("tree %s: adopted again after %s (incarnation %s)", tree_id,
                            "a failed append" if stalled else "its owner lease was lost", driver.incarnation)

    def _taken_over(self, tree_id: TreeID) -> bool:
        """Whether another incarnation activated the tree after this runtime's owner line lost
        its lease (a ``WriterActivated`` not ours after what that line had committed)."""
        line = self._lost_line.get(tree_id)
        if line is None:
            return False
        incarnation, committed, digest = line
        try:
            records = self.store.read(tree_id, after=committed, previous_digest=digest)
        except AgentfoldError:
            return False  # not known: try again at the next poll
        return any(isinstance(r.event, WriterActivated) and r.event.incarnation_id != incarnation for r in records)

    def adopt_orphans(self, budget: float | None = None) -> list[TreeID]:
        """Adopt every live tree nobody owns that needs driving; the trees adopted.

        The trees of a runtime that died (a peer server killed, a command that stopped
        waiting) hold no lease: each is adopted as ``recover`` adopts it (``WriterActivated``;
        a call that was under way settles unknown unless its policy allows a replay). A tree
        whose lease another live runtime holds is left to it; a parked tree with nothing in
        flight is left as it is (input adopts it); a tree this runtime cannot adopt (its
        Program is not in the catalog, a corrupt stream) or whose owner line here stopped on
        a failure is reported once and not tried again until its stored version changes.
        With ``adopt_orphans_every`` the watcher calls this that often, for at most
        ``ORPHAN_SCAN_SECONDS`` at a time (``budget``): a scan that finds many orphans (a dead
        peer's thousand runs) goes on at the next poll, so that the watcher still catches up
        and checks the leases of this runtime's own trees meanwhile.
        """
        _seconds_argument(budget, "adopt_orphans' budget", none=True)
        began = time.monotonic()
        if self._closed or self._draining or not self._leases.healthy():
            return []
        try:
            self.store.check_file()  # an SQLite file removed under the process: nothing to scan
        except StoreFailure:
            return []
        heads = self.store.heads(live_only=True)
        live = {TreeID(h.tree_id) for h in heads}
        with self._lock:
            for memory in (self._orphans_parked, self._orphans_refused):
                for tree_id in [t for t in memory if t not in live]:
                    del memory[tree_id]
        adopted: list[TreeID] = []
        worked = 0  # trees this scan looked at in the store (a lease try, a load, an adoption)
        for head in heads:
            if self._closed or self._draining:  # a scan under way when the server is stopping
                break
            if budget is not None and worked and time.monotonic() - began > budget:
                self._next_orphan_scan = 0.0  # the watcher goes on at its next poll
                break
            tree_id = TreeID(head.tree_id)
            with self._lock:
                if tree_id in self._drivers or tree_id in self._lost:
                    continue
                failed = self._failed.get(tree_id)
                if self._orphans_refused.get(tree_id) == head.version or self._orphans_parked.get(tree_id) == head.version:
                    continue
            if failed is not None and failed.code == "engine.runtime.failed":
                # Its owner line here failed while driving it (an exception in a cycle): adopting
                # again would repeat it, each time appending a WriterActivated. An operator
                # decides. (A store failure or a lost lease passes: ``_adopt_lost`` handles those,
                # and once it let the tree go, the scan may adopt it.)
                self._orphans_refused[tree_id] = head.version
                log.warning("tree %s: nobody owns it, but its owner line here stopped (%s): not adopted again by "
                            "itself; `agentfold recover` adopts it", tree_id, failed.code)
                continue
            worked += 1
            try:
                if head.classification == "parked" and not self._parked_orphan_needs_driving(tree_id, head):
                    continue
                driver = self._try_adopt(tree_id, new_only=True)
            except Exception as exc:  # classified below: the store is down, a refusal, or a bug
                if _store_down(exc):
                    log.debug("orphan scan: the store failed (%s); trying again at the next scan", exc)
                    return adopted
                if not isinstance(exc, AgentfoldError):
                    raise
                self._orphans_refused[tree_id] = head.version
                log.warning("tree %s: nobody owns it and it cannot be adopted: %s", tree_id, exc)
                continue
            if driver is not None and driver.stopped is None:
                adopted.append(tree_id)
                self.orphans_adopted += 1
                log.warning("tree %s: adopted (its owner is gone; incarnation %s)", tree_id, driver.incarnation)
        return adopted

    def _parked_orphan_needs_driving(self, tree_id: TreeID, head: TreeHead) -> bool:
        """Whether a parked tree nobody owns has a call in flight (then: adopt it), holding its
        lease if so. A parked tree whose lease a live runtime holds is not even loaded: a peer
        with many parked runs would otherwise cost a fold of each at every version change."""
        with self._adopt_lock(tree_id):  # re-entered by the look; held for the re-read after it
            with self._lease_look(tree_id) as look:
                if look.held != "look":
                    return False  # driven or held here, or its owner is alive
                if self.needs_recovery(head):
                    look.keep()
                    return True
            # Input admitted while this scan held the lease to look: its writer could not take
            # the tree and appended without driving it (and may have tried again before the
            # lease was free). The index row then moved on: whoever adopts it drives the input.
            # (Still parked, or finished: the next scan looks at it again.)
            latest = self.store.head(tree_id)
            if latest is not None and latest.version != head.version:
                return latest.classification not in ("parked", "terminal")
            with self._lock:
                self._orphans_parked[tree_id] = head.version
            return False

    def stop_dispatching(self) -> None:
        """Grant no dispatch permission from now on (the first half of ``drain``; safe to call
        from a signal handler: it takes no lock)."""
        self._draining = True

    def drain(self, timeout: float) -> bool:
        """Start no call any more; wait up to ``timeout`` seconds for the calls in flight to
        return and their outcomes to be recorded. True when none is left in flight.

        For an owner about to stop (a command that stops waiting, a server shutting down):
        closing at once abandons the calls in flight (recovery records them unknown), and a
        dispatch permission committed after the decision to stop would be recorded for a call
        never made, which recovery also records unknown. Draining first records what returns
        within the grace; the Steps it commits keep their Effects declared, without a dispatch
        permission, and the next owner dispatches them (no unknown). A call still in flight
        at the end is abandoned by ``close`` as before. A timer due after the grace that the
        next owner makes again (replay policy ``same_identity``, a Deadline's) is not waited
        for: it cannot return within the grace, and nothing of it is lost. True when nothing
        else is left in flight.
        """
        _seconds_argument(timeout, "drain's timeout", negative=True)  # before it stops dispatching
        self.stop_dispatching()
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                drivers = [d for d in self._drivers.values() if d.stopped is None]
            if all(d.drained(deadline - time.monotonic()) for d in drivers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def owned_count(self) -> int:
        """How many trees this runtime drives now."""
        with self._lock:
            return len(self._drivers)

    def runs_waiting_for_calls(self) -> int:
        """Runs whose next call waits for a free call slot (``dispatch_workers`` are in flight)."""
        return self._slots.waiting()

    def waiting_timers(self, tree: TreeID | str) -> list[tuple[EffectID, float]]:
        """The timers of ``tree`` waiting in this runtime: ``(effect id, seconds until due by
        its dispatcher's clock)`` each, soonest first (a clock that fails reads as 0)."""
        tree_id = self._tree_ref(tree)
        driver = self._drivers.get(tree_id)
        if driver is None:
            return []
        with driver.lock:
            timers = driver.waiting_timers(list(driver.flights.values()))
        return sorted(((f.effect_id, left if isinstance(left, float) else 0.0) for f, left in timers), key=lambda t: t[1])

    def stored_far_timers(self, tree: TreeID | str, after: float) -> list[tuple[EffectID, float]] | None:
        """For an owner that drives a run only while it waits ``after`` seconds (``agentfold
        recover``): when nobody drives ``tree`` and all its stored state has left to do is wait
        for timers (a Deadline's) due more than ``after`` seconds from now, each ``(effect id,
        seconds until due by its dispatcher's clock)``, soonest first; otherwise None (adopt it).

        Such a run is better left as it is: adopting it appends a ``WriterActivated`` and a new
        dispatch permission of the same timer, and the owner gives it up again before the
        instant, so every periodic ``recover`` would grow its history by two events. A timer
        counts only when it is the frontier of a live Process with no terminal intent, its replay
        policy is ``same_identity`` and its Program's dispatcher is a stock TimerDispatcher
        (``waits_as_timer``) whose ``due`` gives a finite instant; every other live Process must
        be parked (waiting, paused or stopped by an unknown outcome) with nothing in flight.
        Anything else, a tree another runtime owns, or one that cannot be loaded here: None.
        Nothing is appended. The owner lease is taken while the state is read and given back
        (for that moment another writer finds the run owned, as with the orphan scan's look);
        input such a writer recorded meanwhile without driving it moves the index row on,
        which makes the answer None: whoever adopts the run then drives that input. A failing
        store or lease session raises, as adopting would."""
        _seconds_argument(after, "stored_far_timers' after")
        tree_id = self._tree_ref(tree)
        with self._lease_look(tree_id) as look:
            if look.held != "look":
                return None
            try:
                state = self._load(tree_id).state
            except Exception as exc:  # adopting it says why
                if _store_down(exc):
                    raise
                return None
        latest = self.store.head(tree_id)
        if latest is None or latest.version != state.version:
            return None
        timers: list[tuple[EffectID, float]] = []
        for process in state.live.values():
            flights = process.in_flight()
            if process.terminal_intent is not None:
                return None
            if not flights:
                if process.parked():
                    continue
                return None  # a Step to take or an Effect to start
            record = flights[0]
            try:
                program = self._resolve(process.program)
                if not replay_allowed(program, record):  # as the owner that adopts it decides
                    return None
                dispatcher = program.dispatcher if program is not None else None
                if not waits_as_timer(dispatcher):
                    return None
                assert isinstance(dispatcher, TimerDispatcher)
                request = effect_request(state, process.process_id, record.effect_id, program, record.attempt_id)
                instant = timer_instant(dispatcher, request)
                if isinstance(instant, Settlement):
                    return None  # settled at once by its next owner
                left = instant - float(dispatcher.clock())
            except Exception:  # noqa: BLE001 - the owner that adopts it records what fails
                return None
            if not math.isfinite(left) or left <= max(after, 0.0):
                return None
            timers.append((record.effect_id, left))
        return sorted(timers, key=lambda t: t[1]) or None

    def wait_quiet(self, tree: TreeID | str, timeout: float, *,
                   horizon: float | None = None) -> tuple[TreeState, list[tuple[EffectID, float]]]:
        """``wait_idle(tree, timeout, elsewhere=False, past_timers=True, horizon=horizon)`` and the
        timers the tree is then left waiting for (``waiting_timers``; none once it ended): for an
        owner that stops waiting at ``timeout`` or ``horizon`` (a command, an HTTP write) and
        reports what is left."""
        state = self.wait_idle(tree, timeout, elsewhere=False, past_timers=True, horizon=horizon)
        return state, (self.waiting_timers(tree) if state.classification() != "terminal" else [])

    def timers_waiting(self) -> int:
        """TimerDispatcher calls waiting for their instant (they hold no call slot)."""
        with self._timers._cond:
            return self._timers.waiting

    def dispatches_running(self) -> int:
        """Dispatcher calls in progress (after ``close``: the abandoned ones still running)."""
        with self._calls_lock:
            return self._calls_running

    def leases_healthy(self) -> bool:
        """Whether this runtime can take owner leases now (PostgreSQL: its lease session is up)."""
        return self._leases.healthy()

    # -- lifecycle -----------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: the runtime starts and drives no run any more."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeStopped("engine.runtime.closed", "this runtime is closed")

    def close(self, timeout: float = 10.0) -> None:
        """Stop driving every tree and release every lease; in-flight dispatches are abandoned.

        An owner line inside a store call is waited for (up to ``timeout`` seconds): the
        outcome of its append decides what the tree holds and what its callers are told.
        If one is still inside after ``timeout``, close refuses with
        ``engine.runtime.busy`` and the runtime takes no new work; call close again once
        the store call has returned or failed.
        """
        _seconds_argument(timeout, "close's timeout", negative=True)  # before anything closes
        if self._shut:
            return
        self._closed = True
        # No dispatch permission from here on: a cycle that starts now commits its Steps with
        # their Effects declared but not permitted (the next owner dispatches them), instead of
        # a permission for a call this runtime will not make, which recovery could only record
        # as unknown although nothing was called. (A cycle already past this check when close
        # began still commits its permissions: those calls are abandoned, as calls in flight.)
        self.stop_dispatching()
        self._watch_stop.set()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            # First, so that a tree the watcher is adopting again right now (``_adopt_lost``)
            # is registered before the drivers are stopped below, and no adoption starts
            # after this; and because the watcher may be inside a store query: a caller that
            # closes the store right after us would pull the connection from under it
            # (SQLite: a segfault).
            watcher.join(timeout)
        with self._busy_cond:
            if not self._busy_cond.wait_for(lambda: self._busy == 0, timeout):
                raise RuntimeStopped(
                    "engine.runtime.busy",
                    f"{self._busy} owner line(s) of this runtime are still inside a store call",
                    hint="close again once the store call returns or fails",
                )
        self._shut = True
        with self._lock:
            drivers = list(self._drivers.values())
        for driver in drivers:
            with driver.lock:
                if driver.stopped is None:
                    driver.stopped = RuntimeStopped("engine.runtime.closed", "the runtime was closed")
                for flight in driver.flights.values():
                    flight.context.cancelled.set()
                driver.cond.notify_all()
            self._forget(driver)
        self._timers.close()  # the next owner waits for their instants again (same_identity)
        self._owner_pool.shutdown(wait=True, cancel_futures=False)
        self._snapshot_pool.shutdown(wait=True, cancel_futures=False)
        self._dispatch_pool.shutdown(wait=False, cancel_futures=True)
        self._leases.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_main_thread() -> bool:
    """Whether this is the thread a Ctrl-C reaches (a start's first pass, a takeover run by
    the caller): there a KeyboardInterrupt from a Program's code is the operator's."""
    return threading.current_thread() is threading.main_thread()


#: What hosts append to a tree they do not drive: input, never an owner's work.
_INPUT_EVENTS = (SignalAdmitted, EffectResolved, ControlRequested)


def _only_activation(activation: Progress, progress: Progress) -> bool:
    """Whether taking a tree over decided nothing: no call settled or made again, no Step."""
    return (not activation.dispatches and not progress.events and not progress.dispatches
            and all(isinstance(event, WriterActivated) for event in activation.events))


class _Admission:
    """A host's request to apply in the append that takes a tree over (``Runtime._admit``)."""

    __slots__ = ("applied", "fn", "terminal", "value")

    def __init__(self, fn: Callable[[Kernel], tuple[list[TreeEvent], Any]], *, terminal: bool = False) -> None:
        self.fn = fn
        # A terminal intent (cancel, kill, deadline): applied right after the activation, and only
        # when every call the activation makes again for a Process it ends is a timer; else
        # nothing is appended (not ``applied``): the request is recorded first and the tree
        # taken over after it.
        self.terminal = terminal
        self.applied = False  # recorded (in the takeover's append)
        self.value: Any = None


def _copy_of(driver: _Driver) -> TreeState | None:
    """A private copy of an owner line's folded tree (under its lock); None when a Program's
    ``encode_state``/``decode_state`` fails on it (the caller reads the tree from the store)."""
    try:
        # Compact, as a storage snapshot: the copy keeps which inputs were stored as changes.
        return TreeState.from_json(driver.tree.to_json(compact=True), driver.tree.programs)
    except Exception as exc:  # noqa: BLE001 - the Program's own code
        log.warning("tree %s: its folded state does not copy (%s: %s); read from the store instead",
                    driver.tree_id, type(exc).__name__, recorded_text(exc))
        return None


#: Whether an event type is a ProcessStarted or TreeStarted (``index_head``), by type.
_STARTS_PROCESS: dict[type, bool] = {}


def _starts_process(event_type: type) -> bool:
    """``isinstance(event, (ProcessStarted, TreeStarted))`` for an event of this type, answered once
    per type (safe: for these classes it depends on the type alone; their metaclass's check is slow)."""
    starts = _STARTS_PROCESS.get(event_type)
    if starts is None:
        starts = _STARTS_PROCESS[event_type] = issubclass(event_type, (ProcessStarted, TreeStarted))
    return starts


def index_head(
    tree: TreeState, tree_id: TreeID, events: Sequence[TreeEvent], now: str, *, version: int | None = None,
    stored: tuple[str, str, tuple[str, ...]] | None = None,
) -> TreeHead:
    """The ``agentfold_trees`` row after ``events`` (the store fills in the head digest);
    ``version`` when the stored version differs from the folded one; ``progress_only`` when
    its ``row_state`` is ``stored``, the state the row holds now."""
    root = tree.root
    assert tree.start_id is not None
    status, classification, unknown = row_state(tree)
    return TreeHead(
        tree_id=tree_id,
        start_id=tree.start_id,
        root_process_id=root.process_id,
        program=root.program.name,
        status=status,
        classification=classification,
        version=tree.version if version is None else version,
        head_digest="",
        unknown_effect_ids=unknown,
        created_at=now,
        updated_at=now,
        new_processes=tuple([e.process_id for e in events if _starts_process(type(e))]),
        progress_only=stored == (status, classification, unknown),
    )


__all__ = ["CrashPlan", "RandomIds", "Result", "RunHandle", "Runtime", "RuntimeStopped", "index_head"]
