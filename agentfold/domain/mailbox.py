"""Mailbox admission rules (kernel spec 5.2), shared by the runtime and the fold.

The same functions decide whether a host's SignalRequest may enter a mailbox and
whether a recorded ``SignalAdmitted`` was legal, so a stream can never hold input
the runtime would have refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentfold.domain.canonical import digest_of
from agentfold.domain.errors import InvalidInput, Rejected, ResourceLimitExceeded
from agentfold.domain.ids import Digest, SignalID, WaitID
from agentfold.domain.json_schema import recorded_schema_errors, schema_errors

if TYPE_CHECKING:
    from agentfold.domain.program import SignalRequest
    from agentfold.domain.tree import ProcessState


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of checking a batch: the requests that are new (to append)."""

    new: tuple[SignalRequest, ...]

    @property
    def accepted(self) -> bool:
        return bool(self.new)


def _signal_conflict(signal_id: SignalID, why: str) -> Rejected:
    return Rejected(
        "engine.signal.conflict",
        f"signal {signal_id} conflicts with an admitted signal: {why}",
        hint="use a new signal id for different content; resend identical content to retry safely",
        signal_id=signal_id,
    )


def check_admission(
    process: ProcessState,
    requests: Sequence[SignalRequest],
    *,
    source: str = "host",
    signal_schema: object = None,
    check_signal_schema: bool = True,
    parent_schema: bool = False,
    recorded: bool = False,
) -> Admission:
    """Validate a batch of SignalRequests against one Process; all or nothing.

    Raises ``engine.signal.conflict`` (same id, different content),
    ``engine.signal.rejected`` (terminal process, wrong or answered wait,
    current-wait blocking, schema), ``engine.limit.signals`` (budget or mailbox
    capacity). Returns the requests whose identities are new; identical repeats of
    admitted signals are silently deduplicated.
    """
    seen: set[SignalID] = set()
    new: list[SignalRequest] = []
    answered_in_batch: set[WaitID] = set()
    for request in requests:
        if request.id in seen:
            raise _signal_conflict(request.id, "the id appears twice in one batch")
        seen.add(request.id)
        known = process.signal_index.get(request.id)
        if known is not None:
            if known.wait_id != request.wait_id or known.digest != digest_of(request.payload):
                raise _signal_conflict(request.id, "the admitted signal has a different address or payload")
            continue
        new.append(request)
    if not new:
        return Admission(())
    if process.terminal:
        raise Rejected(
            "engine.process.finished",
            f"process {process.process_id} is {process.status}; it admits no more input",
            hint="a finished run takes no more input: start a new run to go on", process_id=process.process_id,
        )
    for request in new:
        if request.wait_id is not None:
            wait = process.waits.get(request.wait_id)
            if wait is None or wait.kind != "external":
                raise Rejected(
                    "engine.signal.rejected",
                    f"wait {request.wait_id} is not an open input wait of process {process.process_id}",
                    hint="answer a wait listed by `agentfold pending`",
                )
            if wait.closed or wait.answered_by is not None or request.wait_id in answered_in_batch:
                raise Rejected(
                    "engine.signal.rejected",
                    f"wait {request.wait_id} of process {process.process_id} was already answered",
                    hint="read the run to see how it went on; `agentfold pending` lists the inputs still open", recorded_hint=False,
                    wait_id=request.wait_id,
                )
            if process.current_wait is not None and process.current_wait != request.wait_id:
                raise Rejected(
                    "engine.signal.rejected",
                    f"wait {request.wait_id} is not the current wait of process {process.process_id}",
                    hint=f"the current wait is {process.current_wait}",
                )
            if wait.response_schema is not None:
                try:
                    problems = (recorded_schema_errors if recorded else schema_errors)(request.payload, wait.response_schema)
                except Exception as exc:  # a schema no check refused (a history of an earlier release)
                    raise Rejected(
                        "engine.signal.rejected",
                        f"wait {request.wait_id} cannot be answered: its response schema is invalid "
                        f"({type(exc).__name__}: {exc})",
                        hint="the Program opened a wait with a schema no answer can be checked against: "
                        "end the run (`agentfold cancel`)",
                    ) from exc
                if problems:
                    raise InvalidInput(
                        "engine.signal.schema",
                        f"answer to wait {request.wait_id} does not satisfy its response schema: "
                        + "; ".join(problems[:3]),
                        hint="send an answer that matches the wait's response schema",
                    )
            answered_in_batch.add(request.wait_id)
        else:
            current = process.current_wait
            if current is not None:
                wait = process.waits.get(current)
                if wait is not None and wait.kind == "external" and current not in answered_in_batch:
                    raise Rejected(
                        "engine.signal.rejected",
                        f"process {process.process_id} waits for input on {current}; "
                        "unaddressed input is refused until that wait is answered",
                        hint=f"answer wait {current} first (a tool's input: `agentfold answer` or Host.answer; a "
                        "Program's own wait: Runtime.deliver_signals with SignalRequest(id, payload, wait_id)), "
                        "then send this input again", recorded_hint=False,
                    )
            # A parent's signal_child goes through the child's ordinary admission (spec §6.4),
            # schema included; the fold (``parent_schema`` False) still accepts the parent
            # signals releases before 2026-12-01 admitted without it.
            if (source == "host" or (source == "parent" and parent_schema)) and check_signal_schema:
                if signal_schema is None:
                    raise Rejected(
                        "engine.signal.rejected",
                        f"process {process.process_id} accepts no unaddressed input",
                        hint="address the signal to one of its waits",
                    )
                problems = (recorded_schema_errors if recorded else schema_errors)(request.payload, signal_schema)
                if problems:
                    raise InvalidInput(
                        "engine.signal.schema",
                        "signal payload does not satisfy the program's signal schema: " + "; ".join(problems[:3]),
                        hint="send a payload that matches the signal_schema of the Program's Descriptor", recorded_hint=False,
                    )
    pending = process.pending_count
    limit = process.limits_max_pending
    if pending + process.reserved_signals + len(new) > limit:
        raise ResourceLimitExceeded(
            "engine.limit.signals",
            f"process {process.process_id} has {pending} pending signals; the mailbox holds at most {limit}",
            hint="send it again once the process has consumed some of its pending signals", recorded_hint=False,
        )
    quota = process.budget.signals
    if not quota.allows(process.accepted_signals + process.allocated.signals + process.reserved_signals, len(new)):
        raise ResourceLimitExceeded(
            "engine.limit.signals",
            f"admitting {len(new)} signal(s) would exceed the signals budget of process {process.process_id}",
            hint="grant the process a larger budget when starting it",
        )
    return Admission(tuple(new))


def payload_digest(payload: object) -> Digest:
    return digest_of(payload)
