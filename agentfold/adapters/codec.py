"""The eventsourcing mapper and transcoder for tree events.

* :class:`OrjsonTranscoder` encodes with orjson, sorted keys (canonical JSON), never pickle;
* :class:`PydanticMapper` maps a :class:`RecordedEvent` (a frozen pydantic model: tree
  UUID, position, timestamp, digest and the domain event) to eventsourcing's
  ``StoredEvent`` and back, sealing the digest into the stored state
  (``agentfold.domain.integrity``) and validating every field on the way back.

The topic of a stored event is ``domain.events:<EventType>`` for schema version 1 and
``domain.events:<EventType>@<n>`` for a later version n (the version lives in the topic,
not in every event's bytes; each event is stored under the lowest version that can carry
it, ``agentfold.domain.events.event_version``); decoding resolves it against the event catalogue,
never by importing what the database names, and refuses a version it does not know.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import orjson
from eventsourcing.persistence import (
    Cipher,
    Compressor,
    Mapper,
    MapperDeserialisationError,
    StoredEvent,
    Transcoder,
)

from agentfold.domain.canonical import MAX_PAYLOAD_BYTES
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import (
    EVENT_TYPES,
    EVENT_VERSIONS,
    EffectDeclared,
    TreeEvent,
    TreeStarted,
    event_body,
    event_from_body,
    event_type,
    event_version,
)
from agentfold.domain.input_changes import UnreadPatch, holds_input_patch
from agentfold.domain.integrity import SealError, chain_digest, content_bytes, seal, unseal

TOPIC_PREFIX = "domain.events:"

#: A stored state is the sealed canonical JSON (first byte ``{``) or, when that JSON is at
#: least ``COMPRESS_MIN_BYTES`` long and deflates smaller, ``COMPRESSED`` followed by its raw
#: DEFLATE stream (RFC 1951, no zlib header). Both forms are read; digests are computed on
#: the JSON, so the form never changes what is verified.
COMPRESSED = b"\x01"
COMPRESS_MIN_BYTES = 384
#: States up to this size are deflated with small tables (memLevel 4), larger ones with zlib's default (8).
SMALL_STATE_BYTES = 4096
#: The largest state a stored event can inflate to (bounded payloads, plus envelope).
MAX_STATE_BYTES = 4 * MAX_PAYLOAD_BYTES
#: The largest snapshot JSON written or read back. A snapshot holds the whole folded tree:
#: a long conversation's reaches 16 MiB at ~4,500 rounds of 1 KiB tool results, or at ~150
#: rounds of 64 KiB ones. A larger tree is not snapshotted again (loads fold from the last
#: snapshot under the bound); the bound only caps what a damaged row can make a reader inflate.
MAX_SNAPSHOT_BYTES = 16 * MAX_STATE_BYTES  # 256 MiB


class StateCompressor(Compressor):
    """Raw DEFLATE of stored states (level 6, a window sized to the state).

    Setting up a deflate stream costs ~10 us whatever the size, so states under
    ``COMPRESS_MIN_BYTES`` (most Steps, checkpoints and dispatch permissions: ids and
    counters, ~30% smaller at best) are stored as they are; results, declarations with
    payloads and anything large are deflated (``scripts/bench`` section ``loop`` measures
    both the bytes and the time per round)."""

    def compress(self, data: bytes) -> bytes:
        size = len(data)
        if size < COMPRESS_MIN_BYTES:
            return data
        window = max(9, min(15, (size - 1).bit_length()))
        # Setting up a stream clears and fills tables sized by memLevel: for a state of a few
        # KB, level 4's tables cost a third of level 8's (~5 vs ~15 us at 400 B, the same
        # bytes out); from ~4 KB on its short hash chains make deflate itself slower.
        deflate = zlib.compressobj(6, zlib.DEFLATED, -window, 4 if size <= SMALL_STATE_BYTES else 8)
        packed = COMPRESSED + deflate.compress(data) + deflate.flush()
        return packed if len(packed) < size else data

    def decompress(self, data: bytes, limit: int = MAX_STATE_BYTES) -> bytes:
        if isinstance(data, str):  # a row edited by hand into SQLite TEXT: not what a writer stores
            raise SealError("stored state is text, not bytes")
        if not isinstance(data, (bytes, bytearray, memoryview)):  # NULL, a number: edited by hand too
            raise SealError(f"stored state is {type(data).__name__}, not bytes")
        data = bytes(data)
        if data[:1] != COMPRESSED:
            return data  # the JSON itself (older stores, small or incompressible states, imports)
        inflate = zlib.decompressobj(-15)
        try:
            out = inflate.decompress(data[1:], limit)
        except zlib.error as exc:
            raise SealError(f"compressed state does not inflate: {exc}") from exc
        if inflate.unconsumed_tail or not inflate.eof or inflate.unused_data:
            raise SealError("compressed state is truncated, too large or followed by extra bytes")
        return out


STATE_COMPRESSOR = StateCompressor()


def stored_json(state: bytes, limit: int = MAX_STATE_BYTES) -> bytes:
    """The sealed JSON of a stored state, whichever form it is stored in (at most ``limit``
    bytes once inflated: ``MAX_SNAPSHOT_BYTES`` for a snapshot)."""
    return STATE_COMPRESSOR.decompress(state, limit)


class OrjsonTranscoder(Transcoder):
    """Canonical JSON via orjson (sorted keys, no whitespace)."""

    def encode(self, obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)

    def decode(self, data: bytes) -> Any:
        return orjson.loads(data)


def chain_tag(name: str, version: int) -> str:
    """An event type as the digest chain (and the stored topic) names it: ``<type>@<n>`` for a
    schema version n > 1."""
    return name if version == 1 else f"{name}@{version}"


#: The stored topic of an input held as changes (``EffectDeclared@2``: a team's Turns). The
#: only topic a reader looks events up by (``holds_topic``); the events table has a partial
#: index on it (``EVENTS_INDEXES``).
PATCHED_START_TOPIC = TOPIC_PREFIX + chain_tag("EffectDeclared", 2)


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """One event as stored: its tree, position, timestamp, chained digest and domain event.

    The domain event itself is validated when decoded; this wrapper only carries it.
    """

    originator_id: uuid.UUID
    originator_version: int
    timestamp: str
    digest: str
    event: TreeEvent

    @property
    def position(self) -> int:
        return self.originator_version

    @property
    def type(self) -> str:
        return event_type(self.event)


class DecodeError(ValueError):
    """A stored event that cannot be decoded or whose digest chain is broken."""

    def __init__(self, position: int, rule: str, detail: str) -> None:
        super().__init__(f"position {position}: {rule}: {detail}")
        self.position = position
        self.rule = rule
        self.detail = detail


class PydanticMapper(Mapper[uuid.UUID]):
    """Seals and unseals tree events (see ``agentfold.domain.integrity``); stored states are compressed
    with :class:`StateCompressor` unless another compressor is given."""

    def __init__(
        self, transcoder: Transcoder, compressor: Compressor | None = None, cipher: Cipher | None = None
    ) -> None:
        super().__init__(transcoder, compressor if compressor is not None else STATE_COMPRESSOR, cipher)

    def encode(
        self, tree_id: str, tree_uuid: uuid.UUID, position: int, event: TreeEvent, timestamp: str, previous: str | None
    ) -> tuple[StoredEvent, str]:
        """Encode one event at ``position``; returns the StoredEvent and its chained digest."""
        name = event_type(event)
        version = event_version(event)
        tag = chain_tag(name, version)
        try:
            content = content_bytes(event_body(event), timestamp)
        except TypeError as exc:  # orjson: "Recursion limit reached" (payloads are checked to leave room)
            raise InvalidInput(
                "payload.invalid", f"the {name} at position {position} cannot be encoded: {exc}: nothing was stored",
                hint="do not change a payload after building its Effect (dispatcher_effect() checks it once)",
            ) from None
        digest = chain_digest(previous, tree_id, position, tag, content)
        state = seal(content, digest)
        if len(state) > MAX_STATE_BYTES:
            # Every reader refuses to inflate a state past the bound: written, it would make the
            # whole history unreadable (a payload changed in place after it was checked).
            raise InvalidInput(
                "payload.too_large", f"the {name} at position {position} is {len(state)} bytes, above the "
                f"{MAX_STATE_BYTES} a stored event may hold: nothing was stored",
                hint="do not change a payload after building its Effect (dispatcher_effect() checks it once)",
            )
        if self.compressor:
            state = self.compressor.compress(state)
        if self.cipher:
            state = self.cipher.encrypt(state)
        return StoredEvent(tree_uuid, position, TOPIC_PREFIX + tag, state), digest

    def decode(
        self, tree_id: str, stored: StoredEvent, previous: str | None, *, verify: bool = True,
        canonical: bool = False,
    ) -> RecordedEvent:
        """Decode and (by default) verify the digest chain of one stored event.

        ``canonical`` (audit, import): the content must also be the canonical JSON of what it
        holds, as every writer stores it. The chain is over the stored bytes, but a consumer
        of the feed rebuilds them from the envelope's values: a valid JSON with a space, keys
        out of order or a member twice would chain here and not there."""
        position = stored.originator_version
        topic = stored.topic
        if not isinstance(topic, str):  # NULL (a row edited by hand): no event type at all
            raise DecodeError(position, "stream.event_type", f"the topic is {topic!r}, not text")
        tag = topic[len(TOPIC_PREFIX) :] if topic.startswith(TOPIC_PREFIX) else ""
        name, _, version_text = tag.partition("@")
        # Version 1 has exactly one spelling (no suffix); later versions are "@<n>", n >= 2.
        schema_version = 1 if not version_text else (int(version_text) if version_text.isascii() and version_text.isdigit() and int(version_text) > 1 and str(int(version_text)) == version_text else -1)
        if name not in EVENT_TYPES:
            raise DecodeError(position, "stream.event_type", f"unknown topic {topic!r}")
        state = stored.state
        try:
            if self.cipher:
                state = self.cipher.decrypt(state)
            if self.compressor:
                state = self.compressor.decompress(state)
            unsealed = unseal(state)
        except SealError as exc:
            raise DecodeError(position, "integrity.format", str(exc)) from exc
        except Exception as exc:
            raise DecodeError(position, "integrity.format", f"{type(exc).__name__}: {exc}") from exc
        if canonical and content_bytes(unsealed.body, unsealed.timestamp) != unsealed.content:
            raise DecodeError(position, "integrity.format",
                              "the stored content is not canonical JSON (sorted keys, no spaces, each member once)")
        if verify:
            expected = chain_digest(previous, tree_id, position, tag, unsealed.content)
            if expected != unsealed.digest:
                raise DecodeError(
                    position, "integrity.digest_chain", f"recorded digest {unsealed.digest} but the chain gives {expected}"
                )
        if not 1 <= schema_version <= EVENT_VERSIONS.get(name, 1):
            raise DecodeError(position, "stream.schema_version", f"unsupported schema version in topic {topic!r}")
        try:
            event = event_from_body(name, unsealed.body)
        except Exception as exc:
            raise DecodeError(position, "stream.event_invalid", f"{name}: {exc}") from exc
        if schema_version == 1 and type(event) is EffectDeclared and holds_input_patch(event.target, event.payload):
            # Written before 2026-12-05 by a Step whose own start_child payload held an input_patch
            # member and no input (kept unread then): read as then, and it stays version 1.
            event = event.model_copy(update={"payload": UnreadPatch(event.payload)})
        if event_version(event) != schema_version:
            raise DecodeError(
                position, "stream.schema_version",
                f"topic {topic!r} says schema version {schema_version}, its body is version {event_version(event)}",
            )
        if position == 1 and isinstance(event, TreeStarted) and event.tree_id != tree_id:
            # The chain binds the stream's tree id, but the fold reads the tree's identity from
            # this event: a history written (or its digests recomputed) under another tree's id
            # would otherwise be shown, driven and exported as that other tree.
            raise DecodeError(
                position, "tree.identity", f"the TreeStarted names tree {event.tree_id}, but it is stored as tree {tree_id}"
            )
        return RecordedEvent(
            originator_id=stored.originator_id,  # type: ignore[arg-type]
            originator_version=position,
            timestamp=unsealed.timestamp,
            digest=unsealed.digest,
            event=event,
        )

    # eventsourcing's Mapper interface, for library tooling (projection runners) ----

    def to_stored_event(self, domain_event: Any) -> StoredEvent:
        raise NotImplementedError("tree events are encoded with their chain: use PydanticMapper.encode")

    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        """Decode without the chain check (the caller has no previous digest)."""
        try:
            return self.decode("", stored_event, None, verify=False)
        except DecodeError as exc:
            raise MapperDeserialisationError(str(exc)) from exc
