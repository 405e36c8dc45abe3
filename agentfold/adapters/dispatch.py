"""The Dispatcher port and the context of one dispatch attempt.

A Dispatcher performs one Effect's external work: ``dispatch(request, context)``
returns a :class:`~agentfold.domain.requests.Settlement`. Raising any exception, timing out or
returning something that is not a valid Settlement makes the outcome **unknown**:
the runtime records it as such and never retries it on its own. Rejecting a request
before any external work is a definite ``Settlement.failed``.

``context.cancelled`` is set when a terminal intent (cancel, kill, deadline) reaches
the Process; a dispatcher should stop promptly. Work already started still settles.
It answers ``is_set()`` and ``wait(timeout)`` like a :class:`threading.Event`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentfold.domain.errors import InvalidInput
from agentfold.domain.program import Effect, EffectPolicy, check_synchronous
from agentfold.domain.requests import EffectRequest, Settlement

_WAITERS_LOCK = threading.Lock()


class CancelFlag:
    """A one-way flag with ``threading.Event``'s ``is_set``/``set``/``wait``.

    Every dispatch gets one, and almost none is ever waited on: a ``threading.Event``
    (a Condition and a lock) per effect was ~3% of the runtime's CPU per effect
    (scripts/bench, chain on memory). The Event is made on the first ``wait``.
    """

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds pass; True when it is set."""
        if self._set:
            return True
        event = self._event
        if event is None:
            with _WAITERS_LOCK:
                event = self._event
                if event is None:
                    event = self._event = threading.Event()
        if self._set:  # set() ran before the Event existed
            event.set()
        return event.wait(timeout)


@dataclass(slots=True)
class DispatchContext:
    cancelled: CancelFlag = field(default_factory=CancelFlag)

    def raise_if_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise DispatchCancelled("the process was asked to stop")


class DispatchCancelled(Exception):
    """Raised by a cooperative dispatcher that stops because its process is stopping."""


class Dispatcher(Protocol):
    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement: ...


class FunctionDispatcher:
    """Adapts a plain function ``fn(request, context) -> Settlement`` to the Dispatcher port.

    ``fn`` must be synchronous: an ``async def`` one is refused here (``program.invalid``),
    since nothing would ever await it. A coroutine returned anyway (a plain function that
    returns one) is closed unrun by the runtime; the outcome stays unknown, as for any non-Settlement."""

    def __init__(self, fn: object) -> None:
        if not callable(fn):
            raise InvalidInput(
                "program.invalid", f"FunctionDispatcher needs a function fn(request, context), got {type(fn).__name__}"
            )
        check_synchronous(f"FunctionDispatcher: {getattr(fn, '__qualname__', type(fn).__name__)}", fn,
                          "program.invalid")
        self._fn: Callable[[EffectRequest, DispatchContext], Any] = fn

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        # A coroutine returned anyway is closed by the runtime, as any dispatcher's (recorded unknown).
        settlement: Settlement = self._fn(request, context)
        return settlement


class TimerDispatcher:
    """A dispatcher whose call is only waiting for an instant (a Deadline's timer).

    A Runtime does not call ``dispatch`` for it: it asks :meth:`due` for the instant and waits
    for every such call on one timer thread of its own, so a waiting timer holds neither a call
    slot (``Runtime(dispatch_workers=N)``) nor a thread. At the instant it records
    :meth:`fired`; when the Process is stopping first, :meth:`stopped` (at once, never unknown).
    ``dispatch`` does the same by blocking, for a caller that calls the dispatcher itself.

    ``clock`` (seconds since the epoch) is read again at the instant and at least every
    :attr:`TICK_SECONDS` while waiting, so a wall clock set forward or back is followed.
    """

    #: The longest wait before the clock is read again.
    TICK_SECONDS = 30.0

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or time.time

    def due(self, request: EffectRequest) -> float | Settlement:
        """The instant (on ``clock``) at which the call settles, or its Settlement now (a
        malformed request is a definite failure). Raising leaves the outcome unknown."""
        raise NotImplementedError

    def fired(self, request: EffectRequest) -> Settlement:
        """The outcome at the instant."""
        return Settlement.succeeded({})

    def stopped(self, request: EffectRequest) -> Settlement:
        """The outcome when the Process stops before the instant."""
        return Settlement.failed({"error": "the timer was stopped before its instant (the Process is stopping)"})

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        due = self.due(request)
        if isinstance(due, Settlement):
            return due
        while True:
            remaining = due - self.clock()
            if remaining <= 0:
                return self.fired(request)
            if context.cancelled.wait(min(remaining, self.TICK_SECONDS)):
                return self.stopped(request)


def never_replay(effect: Effect) -> EffectPolicy:
    return EffectPolicy()
