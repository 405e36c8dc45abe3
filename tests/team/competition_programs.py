"""Programs for the FirstSuccess and Deadline crash tests, built identically in the test process
and in the crash subprocess (``python -m tests.team.competition_programs``; with ``cli ARGS``, the
console script of a deployment that binds them).

* :func:`deadline` is a Deadline whose timer is :class:`LoggedTimer`: the stock
  ``DeadlineDispatcher`` that also appends one line per dispatch (``timer``) and per return
  (``timer-returned``, with the wall-clock time) to the call log of ``tests/team/programs.py``
  (``AGENTFOLD_TEAM_LOG``). The dispatcher is no part of a Program's identity, so the test
  process and the child bind the same ProgramRef.
* :func:`race` is a FirstSuccess over an InputGate (``test.gate``, never answered here), two
  transforms (``test.echo``, which logs each real call as ``echo``, and ``test.crashing``,
  which logs ``crashing`` and, with ``AGENTFOLD_TEAM_CRASH=worker``, ends its process inside
  the call) and that Deadline, with :func:`accept_unless_rejected` (module level, so its
  identity is stable; it logs each call as ``accept``). :func:`race_input` builds three
  candidates: ``a`` the gate, ``b`` a transform, ``d`` the Deadline.

All calls are counted outside the process, across its death.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from agentfold.adapters.team import (
    DeadlineDispatcher,
    FirstSuccessConfig,
    compile_deadline,
    compile_first_success,
)
from agentfold.domain.canonical import JSON
from agentfold.domain.events import ProcessTerminated, StepCommitted, TreeEvent, TreeStarted
from agentfold.domain.program import Program
from agentfold.domain.requests import EffectRequest, Settlement
from tests.team import programs as P

CRASH_EXIT = 75
REJECTED = "reject"


# ---------------------------------------------------------------------------
# Programs


class LoggedTimer(DeadlineDispatcher):
    """The Deadline's timer, with each dispatch (the runtime asks for its instant) and each
    outcome (fired at the instant, or stopped) logged: which process, which attempt."""

    def due(self, request: EffectRequest) -> float | Settlement:
        payload = request.payload if isinstance(request.payload, dict) else {}
        P.log("timer", {"effect": str(request.effect_id), "attempt": str(request.attempt_id),
                        "deadline": payload.get("deadline"), "pid": os.getpid(), "at": time.time()})
        return super().due(request)

    def fired(self, request: EffectRequest) -> Settlement:
        return self._returned(request, super().fired(request))

    def stopped(self, request: EffectRequest) -> Settlement:
        return self._returned(request, super().stopped(request))

    def _returned(self, request: EffectRequest, settlement: Settlement) -> Settlement:
        P.log("timer-returned", {"effect": str(request.effect_id), "status": settlement.status.value,
                                 "pid": os.getpid(), "at": time.time()})
        return settlement


def deadline() -> Program:
    return compile_deadline("test.deadline", "Complete at an instant.", dispatcher=LoggedTimer())


def accept_unless_rejected(key: str, outcome: dict[str, Any]) -> bool:
    """Accept every completed candidate except a transform's output ending with ``reject``
    (``echo: reject``, ``done: reject``); log each call."""
    P.log("accept", key)
    output = outcome["result"]["output"]
    return not (isinstance(output, str) and output.endswith(REJECTED))


def race() -> Program:
    return compile_first_success(FirstSuccessConfig(
        name="test.race",
        candidates=[P.gate(), P.echo(), P.crashing(), deadline()],
        accept=accept_unless_rejected,
        max_candidates=4,
        description="Race a gate, an echo and a deadline.",
    ))


def instant_in(seconds: float) -> str:
    """An RFC 3339 instant ``seconds`` from now (with an offset, as a Deadline requires)."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def race_input(program: str, text: str, at: str) -> list[dict[str, Any]]:
    return [
        {"key": "a", "program": "test.gate", "input": "never answered"},
        {"key": "b", "program": program, "input": text},
        {"key": "d", "program": "test.deadline", "input": at},
    ]


def build(name: str) -> Program:
    if name == "deadline":
        return deadline()
    if name in ("race-reject", "race-crash", "race-win"):
        return race()
    raise ValueError(f"unknown program {name}")


def input_for(name: str, at: str) -> JSON:
    if name == "deadline":
        return at
    if name == "race-reject":
        return race_input("test.echo", "reject", at)  # the echo is rejected: the Deadline must win
    if name == "race-crash":
        return race_input("test.crashing", "reject", at)  # rejected too (once its call is resolved)
    if name == "race-win":
        return race_input("test.echo", "win", at)  # the echo wins
    raise ValueError(f"unknown program {name}")


# ---------------------------------------------------------------------------
# Dying right after a chosen append


class DieAfter:
    """Wraps ``store.append``: right after the append holding a matching event commits, log
    what it held and end the process with ``os._exit(75)``, before the runtime sees the
    append returned (so nothing that follows it, e.g. a dispatch, starts)."""

    def __init__(self, store: Any, what: str) -> None:
        self.what = what
        self.root: str | None = None
        original = store.append

        def append(tree_id: Any, expected: int, events: Sequence[TreeEvent], **kw: Any) -> Any:
            result = original(tree_id, expected, events, **kw)
            self.after(events)
            return result

        store.append = append

    def after(self, events: Sequence[TreeEvent]) -> None:
        for event in events:
            if isinstance(event, TreeStarted):
                self.root = str(event.process_id)
        root = [e for e in events if str(e.process_id) == self.root]
        if self.what == "outcomes":
            hit = [e for e in root if isinstance(e, StepCommitted) and isinstance(e.facts, dict)
                   and e.facts.get("op") == "outcomes"]
            if hit:
                P.log("died-after", {"what": self.what, "facts": hit[0].facts, "at": time.time(),
                                     "events": [type(e).__name__ for e in events]})
                os._exit(CRASH_EXIT)
        elif self.what == "root-terminated":
            ended = [e for e in root if isinstance(e, ProcessTerminated)]
            if ended:
                P.log("died-after", {"what": self.what, "status": ended[0].status, "output": ended[0].output,
                                     "at": time.time(),
                                     "events": [type(e).__name__ for e in events]})
                os._exit(CRASH_EXIT)
        else:
            raise ValueError(f"unknown point {self.what}")


# ---------------------------------------------------------------------------
# The crash driver: ``python -m tests.team.competition_programs STORE_URL PROGRAM START_ID SECONDS MODE``
#
# The child computes the Deadline's instant itself (now + SECONDS, after its imports, so the
# interpreter's start does not eat into the time left) and logs the input it starts (``input``).
# MODE ``run``: run to the end (a JSON summary on stdout, exit 0; ``race-crash`` under
# AGENTFOLD_TEAM_CRASH=worker dies inside the ``test.crashing`` call). ``timer-waits:<hold>``: once
# the timer's dispatcher has been entered (its dispatch permission is committed), let it wait
# ``hold`` seconds, then die. ``after:outcomes``: die right after the append holding the root's
# first ``outcomes`` Step (a candidate's outcome recorded). ``after:root-terminated``: die right
# after the append holding the root's termination. ``crash:<point>``: the Runtime's crash plan
# (``--crash-after``, docs/cli.md). Every death is os._exit(75); exit 4: an error.


def cli(argv: list[str]) -> int:
    """A deployment's console script binding these Programs: agentfold's CLI (docs/python.md)."""
    from agentfold.adapters.cli import main as agentfold_main
    from agentfold.adapters.sources import ProgramSources, default_sources

    return agentfold_main(argv, sources=default_sources().plus(ProgramSources(programs=(deadline(), race()))))


def main(argv: list[str]) -> int:
    if argv[:1] == ["cli"]:
        return cli(argv[1:])
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.runtime import CrashPlan, Runtime

    url, name, start_id, seconds, mode = argv
    program = build(name)
    store = EventStore(url)
    if mode.startswith("after:"):
        DieAfter(store, mode.removeprefix("after:"))
    crash = CrashPlan.parse(mode.removeprefix("crash:")) if mode.startswith("crash:") else None
    runtime = Runtime(store, Catalog([program]), poll_interval=0, crash=crash)
    try:
        input = input_for(name, instant_in(float(seconds)))
        P.log("input", input)
        handle = runtime.start(program, input, start_id=start_id)
        if mode.startswith("timer-waits:"):
            P.wait_for(lambda: P.entries("timer"), "the timer to be dispatched")
            time.sleep(float(mode.removeprefix("timer-waits:")))
            P.log("died-after", {"what": "timer-waits", "at": time.time()})
            os._exit(CRASH_EXIT)
        result = handle.result(timeout=P.HOLD_SECONDS)
        print(json.dumps({"status": result.status, "output": result.output}))
        return 0
    finally:
        runtime.close()
        store.close()


if __name__ == "__main__":
    import sys
    import traceback

    from tests.team import competition_programs as _self  # the functions under their importable names

    try:
        sys.exit(_self.main(sys.argv[1:]))
    except Exception:  # noqa: BLE001 - report to the test
        traceback.print_exc()
        sys.exit(4)
