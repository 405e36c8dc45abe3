"""Tamper-evident digest chains over stored events (pure).

Each stored event's state is the canonical JSON object

    {"digest": "sha256:...", "event": {...}, "timestamp": "..."}

and its digest chains it to the previous event of the same tree:

    digest_n = SHA-256( previous_digest_text | NUL | tree_id | NUL | position | NUL | type | NUL | content )

where ``content`` is the canonical JSON of the object without its ``digest`` member
and ``previous_digest_text`` is empty for position 1. Because ``digest`` sorts first
in canonical JSON, the stored bytes are exactly ``{"digest":"<d>",`` followed by the
content without its opening brace: verification slices, it never re-serializes.

Changing any byte of an event's JSON, deleting, reordering or inserting an event
breaks the chain at that position.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.ids import Digest

_PREFIX = b'{"digest":"'
_DIGEST_LEN = len("sha256:") + 64
_SPLIT = len(_PREFIX) + _DIGEST_LEN + 2  # closing quote and comma


def content_bytes(body: dict[str, Any], timestamp: str) -> bytes:
    return canonical_bytes({"event": body, "timestamp": timestamp})


def chain_digest(previous: str | None, tree_id: str, position: int, type_name: str, content: bytes) -> Digest:
    header = f"{previous or ''}\x00{tree_id}\x00{position}\x00{type_name}\x00".encode("ascii")
    return str.__new__(Digest, "sha256:" + hashlib.sha256(header + content).hexdigest())


def seal(content: bytes, digest: str) -> bytes:
    """The stored state: the digest member spliced in front of the canonical content."""
    return _PREFIX + digest.encode("ascii") + b'",' + content[1:]


@dataclass(frozen=True, slots=True)
class Unsealed:
    digest: str
    content: bytes
    body: dict[str, Any]
    timestamp: str


class SealError(ValueError):
    pass


def unseal(state: bytes) -> Unsealed:
    """Split stored state into its recorded digest and canonical content (no re-encoding)."""
    if not state.startswith(_PREFIX) or len(state) < _SPLIT or state[_SPLIT - 2 : _SPLIT] != b'",':
        raise SealError("stored state does not start with a digest member")
    digest = state[len(_PREFIX) : len(_PREFIX) + _DIGEST_LEN].decode("ascii")
    content = b"{" + state[_SPLIT:]
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise SealError(f"stored state is not JSON: {exc}") from exc
    if not isinstance(value, dict) or set(value) != {"event", "timestamp"}:
        raise SealError("stored state must hold exactly event and timestamp")
    return Unsealed(digest, content, value["event"], str(value["timestamp"]))
