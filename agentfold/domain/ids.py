"""Identities with canonical parse and format (kernel spec 1).

Every identity is an immutable ``str`` subclass that validates on construction, so a
value of type :class:`ProcessID` is always well formed and formats back to exactly
the text it was parsed from.

* free-form ids (ProcessID, ChildKey, StartID, SignalID, WaitKey, and the parsers
  for engine-minted WaitID / EffectID): 1-256 ASCII bytes of ``[A-Za-z0-9-_.:]``;
* canonical hex ids: ``Digest`` (``sha256:`` + 64 hex), ``TreeIncarnationID``
  (``incarnation:`` + 32 hex), ``EffectAttemptID`` (``attempt:`` + 32 hex),
  ``TreeID`` (``tree:`` + 32 hex);
* derived ids: prefix + hex SHA-256 over the tag and the parts joined with NUL
  (``derive``), so the same Process/step/index always yields the same EffectID,
  WaitID, child ProcessID and settlement SignalID across crashes and writers.
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid as _uuid
from collections.abc import Callable
from typing import Any, ClassVar, Self

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from agentfold.domain.errors import InvalidInput

_FREE_FORM = re.compile(r"[A-Za-z0-9\-_.:]{1,256}")


class _Identity(str):
    """Base of all identities: a validated, immutable string."""

    __slots__ = ()
    kind: ClassVar[str] = "identity"

    def __new__(cls, value: str) -> Self:
        if type(value) is cls:
            return value
        if not isinstance(value, str):
            raise InvalidInput("identity.invalid", f"{cls.kind} must be a string, got {type(value).__name__}",
                               hint=f"pass the {cls.kind} as text (a str), e.g. str(value)", recorded_hint=False)
        cls._check(value)
        return super().__new__(cls, value)

    @classmethod
    def _check(cls, value: str) -> None:
        if not (_FREE_FORM.fullmatch(value) and value.isascii()):
            raise InvalidInput(
                "identity.invalid",
                f"invalid {cls.kind} {value[:80]!r}",
                hint="use 1-256 ASCII characters from [A-Za-z0-9-_.:]",
            )

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse the canonical text; never creates the referenced object."""
        return cls(text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str.__repr__(self)})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls,
            core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(str),
        )


class ProcessID(_Identity):
    kind = "process id"


class ChildKey(_Identity):
    kind = "child key"


class StartID(_Identity):
    kind = "start id"


class SignalID(_Identity):
    kind = "signal id"

    ENGINE_PREFIX: ClassVar[str] = "signal:engine:"

    @property
    def engine_owned(self) -> bool:
        """Engine-generated signals (settlements, wait openings) use a reserved namespace."""
        return self.startswith(self.ENGINE_PREFIX)


class WaitID(_Identity):
    kind = "wait id"


class WaitKey(_Identity):
    kind = "wait key"


class EffectID(_Identity):
    kind = "effect id"


_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class _HexIdentity(_Identity):
    prefix: ClassVar[str] = ""
    width: ClassVar[int] = 16  # bytes

    @classmethod
    def _check(cls, value: str) -> None:
        body = value[len(cls.prefix) :]
        pattern = _HEX32 if cls.width == 16 else _HEX64
        if not value.startswith(cls.prefix) or len(body) != cls.width * 2 or not pattern.fullmatch(body):
            raise InvalidInput(
                "identity.invalid",
                f"invalid {cls.kind} {value[:80]!r}",
                hint=f"expected {cls.prefix!r} followed by {cls.width * 2} lowercase hex digits",
            )

    @property
    def hex(self) -> str:
        return self[len(self.prefix) :]

    @classmethod
    def from_bytes(cls, raw: bytes) -> Self:
        """Build from ``width`` random or derived bytes (the caller owns randomness)."""
        if len(raw) != cls.width:
            raise InvalidInput("identity.invalid", f"{cls.kind} needs {cls.width} bytes, got {len(raw)}",
                               hint=f"pass exactly {cls.width} bytes", recorded_hint=False)
        return str.__new__(cls, cls.prefix + raw.hex())  # well formed by construction


class Digest(_HexIdentity):
    kind = "digest"
    prefix = "sha256:"
    width = 32

    @classmethod
    def of(cls, data: bytes) -> Digest:
        """SHA-256 of exactly these bytes."""
        return str.__new__(cls, "sha256:" + hashlib.sha256(data).hexdigest())


class TreeIncarnationID(_HexIdentity):
    kind = "incarnation id"
    prefix = "incarnation:"


class EffectAttemptID(_HexIdentity):
    kind = "attempt id"
    prefix = "attempt:"


class TreeID(_HexIdentity):
    """The identity of one root tree's event stream, derived from its StartID."""

    kind = "tree id"
    prefix = "tree:"

    @property
    def uuid(self) -> _uuid.UUID:
        return _tree_uuid(self.hex)

    @classmethod
    def from_uuid(cls, value: _uuid.UUID) -> TreeID:
        return cls(cls.prefix + value.hex)

    @classmethod
    def for_start(cls, start_id: StartID) -> TreeID:
        """Starting twice with one StartID addresses the same stream: idempotent start."""
        return cls.from_bytes(_hash("tree", start_id)[:16])


@functools.lru_cache(maxsize=1024)
def _tree_uuid(hex_text: str) -> _uuid.UUID:
    """A tree's UUID (every append asks for it): cached, as a UUID is immutable and a pure function
    of the text (a text that is no UUID raises, and is not cached)."""
    return _uuid.UUID(hex=hex_text)


def _hash(tag: str, *parts: str | int) -> bytes:
    # One buffer, one update: the same bytes as updating part by part, at a third of the cost.
    return hashlib.sha256("\x00".join((tag, *map(str, parts))).encode("ascii")).digest()


def derive(prefix: str, tag: str, *parts: str | int) -> str:
    """``prefix`` + hex SHA-256 of the tag and parts, NUL-separated (kernel spec 1.3)."""
    return prefix + _hash(tag, *parts).hex()


def _effect_id(process_id: ProcessID, step: int, index: int) -> EffectID:
    # Safe: derive("effect:", "effect", process_id, step, index) (its NUL-joined str() parts, one hex
    # digest) spelled out for the kernel's hottest derivation.
    data = f"effect\x00{process_id!s}\x00{step!s}\x00{index!s}".encode("ascii")
    return str.__new__(EffectID, "effect:" + hashlib.sha256(data).hexdigest())


#: EffectID of the ``index``-th (zero-based) Effect of one-based Step ``step``. Derived ids
#: are pure, and the kernel and the fold ask for each twice: cached.
effect_id: Callable[[ProcessID, int, int], EffectID] = functools.lru_cache(maxsize=4096, typed=True)(_effect_id)


def _check_derived(value: str, prefix: str, kind: str, listed_by: str) -> None:
    """A derived id a host names: the kernel makes every one of them as ``prefix`` + 64 lowercase
    hex digits, so anything else cannot name what the host means."""
    if not (value.startswith(prefix) and _HEX64.fullmatch(value, len(prefix))):
        raise InvalidInput(
            "identity.invalid",
            f"invalid {kind} {value[:80]!r}",
            hint=f"expected {prefix!r} followed by 64 lowercase hex digits; `agentfold {listed_by}` lists them",
        )


def parse_effect_id(text: str) -> EffectID:
    """An EffectID a host names (to resolve or replay it)."""
    value = EffectID(text)
    _check_derived(value, "effect:", "effect id", "unknown")
    return value


def parse_wait_id(text: str) -> WaitID:
    """A WaitID a host names (to answer it)."""
    value = WaitID(text)
    _check_derived(value, "wait:", "wait id", "pending")
    return value


def wait_id_for(effect: EffectID) -> WaitID:
    """The WaitID a wait or child-wait Effect opens."""
    return str.__new__(WaitID, derive("wait:", "wait", effect))


def _settlement_signal_id(effect: EffectID) -> SignalID:
    # Safe: derive(SignalID.ENGINE_PREFIX, "signal", effect) spelled out (one per Effect).
    data = f"signal\x00{effect!s}".encode("ascii")
    return str.__new__(SignalID, "signal:engine:" + hashlib.sha256(data).hexdigest())


#: The engine-owned SignalID that delivers an Effect's settlement (cached like ``effect_id``).
settlement_signal_id: Callable[[EffectID], SignalID] = functools.lru_cache(maxsize=4096, typed=True)(
    _settlement_signal_id
)


def wait_opened_signal_id(wait: WaitID) -> SignalID:
    return str.__new__(SignalID, derive(SignalID.ENGINE_PREFIX, "wait-opened", wait))


def child_wait_satisfied_signal_id(wait: WaitID) -> SignalID:
    return str.__new__(SignalID, derive(SignalID.ENGINE_PREFIX, "child-wait-satisfied", wait))


def child_process_id(start_effect: EffectID) -> ProcessID:
    """The ProcessID of the child a start-child Effect creates."""
    return str.__new__(ProcessID, derive("process:", "child", start_effect))


def root_process_id(random16: bytes) -> ProcessID:
    """Root ProcessIDs are ``process:`` + 32 hex of 16 random bytes minted by the runtime."""
    if len(random16) != 16:
        raise InvalidInput("identity.invalid", "a root process id needs 16 random bytes", hint="pass os.urandom(16)", recorded_hint=False)
    return ProcessID("process:" + random16.hex())
