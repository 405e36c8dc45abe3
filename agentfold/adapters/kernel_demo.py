"""The kernel demo Program ``demo.payment``: charge a customer, then send a receipt.

Until the Interaction lands, this small Program is what ``scripts/demo`` runs to show
the kernel's promise: a crash in the middle of an external call never makes it run
twice, and an outcome the crash made unknown waits for a host instead of being
guessed.

The Program takes ``{"customer", "amount_cents", "side_effect_log"}`` and runs three
Steps:

1. declare a dispatcher Effect ``charge`` (replay policy ``never``: charging twice
   is not the same operation as charging once);
2. on a succeeded charge, declare ``send_receipt`` (replay policy ``same_identity``:
   the mailer deduplicates by message id, so sending again under the same EffectID
   is the same operation); on a failed charge, fail with ``demo.payment.charge_failed``;
3. complete with ``{"charge", "receipt", "receipt_sent"}``.

The "external systems" are one file, the side-effect log: each real charge and each
real delivery appends one JSON line to it, so a test or an operator counts the calls
outside the process that made them (they survive the process's death). A line is
``{"action": "charge", "charge_id", "customer", "amount_cents", "effect_id",
"attempt_id"}`` or ``{"action": "send_receipt", "message_id", "customer",
"charge_id", "effect_id", "attempt_id"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.scenario import SideEffectLogRefused, open_side_effect_log
from agentfold.domain.errors import Failure, FailureKind
from agentfold.domain.ids import Digest
from agentfold.domain.program import (
    Complete,
    Continue,
    Descriptor,
    Effect,
    EffectPolicy,
    Fail,
    Program,
    Replay,
    SettlementStatus,
    Signal,
    Step,
    dispatcher_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement

PROGRAM_NAME = "demo.payment"

CHARGE_FAILED = "demo.payment.charge_failed"

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["customer", "amount_cents", "side_effect_log"],
    "properties": {
        "customer": {"type": "string", "minLength": 1},
        "amount_cents": {"type": "integer", "minimum": 1},
        "side_effect_log": {"type": "string", "minLength": 1},
    },
    "additionalProperties": False,
}

OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["charge", "receipt", "receipt_sent"],
}

# Bump when decide/evolve change meaning: the ProgramRef of stored trees then no longer
# matches, and the CLI refuses to drive an old tree with new code.
IMPLEMENTATION_DIGEST = Digest.of(b"adapters.kernel_demo:demo.payment:1")
CONFIGURATION_DIGEST = Digest.of(b"adapters.kernel_demo:no-configuration")


# ---------------------------------------------------------------------------
# Strategy (pure)


class PaymentStrategy:
    """decide/evolve over a small JSON state ``{"input", "phase", "charge"}``."""

    def initial(self, input: Any) -> Any:
        return {"input": input, "phase": "start", "charge": None}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        order = state["input"]
        if phase == "start":
            charge = dispatcher_effect(
                {
                    "action": "charge",
                    "customer": order["customer"],
                    "amount_cents": order["amount_cents"],
                    "side_effect_log": order["side_effect_log"],
                }
            )
            return Step(0, Continue((charge,)), {"phase": "charging"})
        settlement = _settlement(window)
        if settlement is None:  # pragma: no cover - the kernel delivers settlements before the next Step
            raise RuntimeError(f"no settlement in the window during phase {phase}")
        if phase == "charging":
            if settlement.status is not SettlementStatus.SUCCEEDED:
                failure = Failure(FailureKind.EXTERNAL, CHARGE_FAILED, f"the charge was declined: {settlement.payload}")
                return Step(len(window), Fail(failure), {"phase": "failed"})
            receipt = dispatcher_effect(
                {
                    "action": "send_receipt",
                    "customer": order["customer"],
                    "charge": settlement.payload,
                    "side_effect_log": order["side_effect_log"],
                }
            )
            return Step(len(window), Continue((receipt,)), {"phase": "sending", "charge": settlement.payload})
        if phase == "sending":
            sent = settlement.status is SettlementStatus.SUCCEEDED
            output = {"charge": state["charge"], "receipt": settlement.payload, "receipt_sent": sent}
            return Step(len(window), Complete(output), {"phase": "done"})
        raise RuntimeError(f"unexpected phase {phase!r}")

    def evolve(self, state: Any, facts: Any, consumed: Sequence[Signal]) -> Any:
        return {**state, **(facts or {})}

    def encode_state(self, state: Any) -> Any:
        return state

    def decode_state(self, data: Any) -> Any:
        return data


def _settlement(window: Sequence[Signal]) -> Signal | None:
    for signal in window:
        if signal.status is not None:
            return signal
    return None


def payment_policy(effect: Effect) -> EffectPolicy:
    """``charge`` is never repeated; ``send_receipt`` is idempotent by message id."""
    payload = effect.payload if isinstance(effect.payload, dict) else {}
    if payload.get("action") == "send_receipt":
        return EffectPolicy(replay=Replay.SAME_IDENTITY)
    return EffectPolicy(replay=Replay.NEVER)


# ---------------------------------------------------------------------------
# Dispatcher (I/O: the side-effect log stands in for the payment provider and the mailer)


def _derived(prefix: str, effect_id: str) -> str:
    return prefix + hashlib.sha256(effect_id.encode("ascii")).hexdigest()[:16]


def charge_id_for(effect_id: str) -> str:
    """The provider's charge id: derived from the EffectID (the charge's idempotency key)."""
    return _derived("ch_", effect_id)


def message_id_for(effect_id: str) -> str:
    return _derived("msg_", effect_id)


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a side-effect log (an absent file is an empty log)."""
    file = Path(path)
    return _parse_lines(file.read_text()) if file.exists() else []


def _parse_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _append_line(path: str, line: dict[str, Any]) -> None:
    fd = open_side_effect_log(path)  # in `serve`: only inside its --side-effect-dir (SideEffectLogRefused)
    try:
        _write_line(fd, line)
    finally:
        os.close(fd)


def _write_line(fd: int, line: dict[str, Any]) -> None:
    # O_APPEND + fsync: the line is on disk before the dispatcher returns, so a crash
    # right after the side effect still leaves the evidence a host investigates.
    os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())
    os.fsync(fd)


def _read_lines(fd: int) -> list[dict[str, Any]]:
    """Every line of the log open on ``fd``, read from its start."""
    data, offset = bytearray(), 0
    while chunk := os.pread(fd, 1 << 16, offset):
        data += chunk
        offset += len(chunk)
    return _parse_lines(data.decode())


def dispatch_payment(request: EffectRequest, context: DispatchContext) -> Settlement:
    try:
        return _dispatch_payment(request)
    except SideEffectLogRefused as exc:  # definite: nothing was charged or sent
        return Settlement.failed({"error": f"refused: this server does not append to the side-effect log: {exc}"})


def _dispatch_payment(request: EffectRequest) -> Settlement:
    payload = request.payload
    log = str(payload["side_effect_log"])
    action = payload.get("action")
    if action == "charge":
        charge = {
            "charge_id": charge_id_for(request.effect_id),
            "customer": payload["customer"],
            "amount_cents": payload["amount_cents"],
        }
        _append_line(log, {"action": "charge", **charge, "effect_id": request.effect_id, "attempt_id": request.attempt_id})
        return Settlement.succeeded(charge)
    if action == "send_receipt":
        message_id = message_id_for(request.effect_id)
        charge_id = (payload.get("charge") or {}).get("charge_id")
        # The mailer delivers a message id once; a repeated attempt returns the same receipt.
        # Read and appended through one descriptor, opened as every append is (in `serve`:
        # inside its --side-effect-dir, no symbolic link followed).
        fd = open_side_effect_log(log, readable=True)
        try:
            if not any(line.get("message_id") == message_id for line in _read_lines(fd)):
                _write_line(fd, {
                    "action": "send_receipt",
                    "message_id": message_id,
                    "customer": payload["customer"],
                    "charge_id": charge_id,
                    "effect_id": request.effect_id,
                    "attempt_id": request.attempt_id,
                })
        finally:
            os.close(fd)
        return Settlement.succeeded({"message_id": message_id, "to": payload["customer"]})
    return Settlement.failed({"error": f"unknown action {action!r}"})


# ---------------------------------------------------------------------------
# The Program


def payment_program() -> Program:
    """The exact ``demo.payment`` binding (same ProgramRef in every process)."""
    return Program(
        Descriptor(
            PROGRAM_NAME,
            description="Charge a customer once, then send a receipt (agentfold kernel demo).",
            input_schema=INPUT_SCHEMA,
            output_schema=OUTPUT_SCHEMA,
        ),
        PaymentStrategy(),
        IMPLEMENTATION_DIGEST,
        CONFIGURATION_DIGEST,
        policy=payment_policy,
        dispatcher=FunctionDispatcher(dispatch_payment),
    )


def payment_input(customer: str, amount_cents: int, side_effect_log: str | Path) -> dict[str, Any]:
    return {"customer": customer, "amount_cents": amount_cents, "side_effect_log": str(Path(side_effect_log).resolve())}


__all__ = [
    "CHARGE_FAILED",
    "PROGRAM_NAME",
    "charge_id_for",
    "message_id_for",
    "payment_input",
    "payment_program",
    "read_log",
]
