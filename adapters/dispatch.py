"""The Dispatcher port and the context of one dispatch attempt.

A Dispatcher performs one Effect's external work: ``dispatch(request, context)``
returns a :class:`~domain.requests.Settlement`. Raising any exception, timing out or
returning something that is not a valid Settlement makes the outcome **unknown**:
the runtime records it as such and never retries it on its own. Rejecting a request
before any external work is a definite ``Settlement.failed``.

``context.cancelled`` is set when a terminal intent (cancel, kill, deadline) reaches
the Process; a dispatcher should stop promptly. Work already started still settles.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from domain.program import Effect, EffectPolicy
from domain.requests import EffectRequest, Settlement


@dataclass(slots=True)
class DispatchContext:
    cancelled: threading.Event = field(default_factory=threading.Event)

    def raise_if_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise DispatchCancelled("the process was asked to stop")


class DispatchCancelled(Exception):
    """Raised by a cooperative dispatcher that stops because its process is stopping."""


class Dispatcher(Protocol):
    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement: ...


class FunctionDispatcher:
    """Adapts a plain function ``fn(request, context) -> Settlement`` to the Dispatcher port."""

    def __init__(self, fn: object) -> None:
        self._fn = fn

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        return self._fn(request, context)  # type: ignore[operator, no-any-return]


def never_replay(effect: Effect) -> EffectPolicy:
    return EffectPolicy()
