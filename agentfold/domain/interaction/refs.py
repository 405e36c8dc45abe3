"""References: ToolCallRef, ToolChildKey and DelegateChildKey (spec 2.9).

A :class:`ToolCallRef` identifies one logical tool call by its requesting
Interaction Process, the one-based model call sequence and the zero-based position
of the call in that response. Its only text form is ``<process_id>/<sequence>/<index>``
in base 10; parsing accepts nothing else (no leading zeros, signs, spaces, extra
parts or overflow). It is immutable, hashable, usable as a dict key and as JSON
(its text). It identifies a call; it proves no execution and authorizes nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import ChildKey, ProcessID

MAX_U64 = (1 << 64) - 1
MAX_U32 = (1 << 32) - 1
TOOL_CHILD_PREFIX = "interaction.tool."
DELEGATE_CHILD_PREFIX = "interaction.delegate.child."


def _bad_ref(text: object, why: str) -> InvalidInput:
    return InvalidInput(
        "interaction.tool_call_ref.invalid",
        f"invalid tool call reference {str(text)[:120]!r}: {why}",
        hint="use the canonical form <process_id>/<model_call_sequence>/<tool_call_index>",
    )


def _decimal(text: str, maximum: int) -> int | None:
    if not text or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    if str(value) != text or value > maximum:
        return None
    return value


@dataclass(frozen=True, slots=True, order=True)
class ToolCallRef:
    process_id: ProcessID
    model_call_sequence: int
    tool_call_index: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "process_id", ProcessID(self.process_id))
        if not isinstance(self.model_call_sequence, int) or not 0 < self.model_call_sequence <= MAX_U64:
            raise _bad_ref(self, "the model call sequence must be between 1 and 2^64-1")
        if not isinstance(self.tool_call_index, int) or not 0 <= self.tool_call_index <= MAX_U32:
            raise _bad_ref(self, "the tool call index must be between 0 and 2^32-1")

    def __str__(self) -> str:
        return f"{self.process_id}/{self.model_call_sequence}/{self.tool_call_index}"

    @classmethod
    def parse(cls, text: Any) -> ToolCallRef:
        """Parse the canonical text only; re-encoding must give exactly the input."""
        if not isinstance(text, str):
            raise _bad_ref(text, "a reference is text")
        parts = text.split("/")
        if len(parts) != 3:
            raise _bad_ref(text, "expected exactly three parts separated by '/'")
        try:
            pid = ProcessID(parts[0])
        except InvalidInput as exc:
            raise _bad_ref(text, "the process id is invalid") from exc
        sequence = _decimal(parts[1], MAX_U64)
        index = _decimal(parts[2], MAX_U32)
        if sequence is None or sequence == 0:
            raise _bad_ref(text, "the model call sequence must be a canonical decimal above 0")
        if index is None:
            raise _bad_ref(text, "the tool call index must be a canonical decimal")
        ref = cls(pid, sequence, index)
        if str(ref) != text:
            raise _bad_ref(text, "not in canonical form")
        return ref

    def to_json(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"ToolCallRef({str(self)!r})"


def tool_child_key(model_call_sequence: int, tool_call_index: int) -> ChildKey:
    """``interaction.tool.<sequence>.<index>``: the child that serves one tool call."""
    if model_call_sequence <= 0 or tool_call_index < 0:
        raise InvalidInput("interaction.child_key.invalid", "sequence must be > 0 and index >= 0")
    return ChildKey(f"{TOOL_CHILD_PREFIX}{model_call_sequence}.{tool_call_index}")


def delegate_child_key(model_call_sequence: int, call_id: str, call_name: str) -> ChildKey:
    """``interaction.delegate.child.<hex>``: SHA-256 of sequence, call id and call name, NUL-separated."""
    if model_call_sequence <= 0 or not call_id or not call_name:
        raise InvalidInput("interaction.child_key.invalid", "a delegate key needs a sequence > 0, a call id and a name")
    h = hashlib.sha256()
    h.update(str(model_call_sequence).encode())
    h.update(b"\x00")
    h.update(call_id.encode())
    h.update(b"\x00")
    h.update(call_name.encode())
    return ChildKey(DELEGATE_CHILD_PREFIX + h.hexdigest())


def tool_call_ref_of_child(parent_id: ProcessID | None, child_key: ChildKey | None) -> ToolCallRef | None:
    """The ToolCallRef a Tool child serves, read from its relation; None for any other Process."""
    if parent_id is None or child_key is None or not child_key.startswith(TOOL_CHILD_PREFIX):
        return None
    rest = child_key[len(TOOL_CHILD_PREFIX) :]
    seq_text, _, index_text = rest.partition(".")
    sequence = _decimal(seq_text, MAX_U64)
    index = _decimal(index_text, MAX_U32)
    if sequence is None or sequence == 0 or index is None:
        return None
    if tool_child_key(sequence, index) != child_key:
        return None
    return ToolCallRef(parent_id, sequence, index)
