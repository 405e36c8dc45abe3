"""Canonical JSON and bounded payloads.

Canonical JSON is orjson with sorted object keys and no whitespace. Digests of
payloads and events are SHA-256 over exactly those bytes. A payload is any JSON
value (objects with string keys, arrays, strings, finite numbers, booleans, null);
non-finite floats, integers beyond 64 bits and non-string keys are refused, so a
value always survives a round trip through the store unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import Digest

JSON = Any
"""A JSON value as Python objects (dict, list, str, int, float, bool, None)."""

MAX_PAYLOAD_BYTES = 4 << 20
"""Upper bound of one payload (input, output, signal, settlement) in canonical bytes."""

MAX_TOOL_INPUT_BYTES = 1 << 20
"""Upper bound of a Tool input prompt or answer (seed: tool.MaxInputBytes, 1 MiB)."""

_OPTIONS = orjson.OPT_SORT_KEYS


def canonical_bytes(value: JSON) -> bytes:
    """Canonical JSON bytes of an already valid JSON value."""
    return orjson.dumps(value, option=_OPTIONS)


def digest_of(value: JSON) -> Digest:
    return Digest.of(canonical_bytes(value))


def _text(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("payload.invalid", f"the text at {path} is not valid UTF-8 (it holds a lone surrogate)",
                           hint="decode bytes with errors='replace' (or drop the lone surrogate) before passing the text",
                           recorded_hint=False) from None


NON_FINITE_HINT = "JSON has no NaN or infinity: send null or a string instead"

#: Values orjson writes as JSON of its own (stored as that JSON; what is read back is it). The
#: datetime types are recognised by name: this layer imports no clock module.
_WRITTEN_BY_ORJSON = (uuid.UUID, enum.Enum)
_DATETIME_TYPES = frozenset({"datetime", "date", "time"})


def _a_datetime(value: Any) -> bool:
    return any(c.__module__ == "datetime" and c.__name__ in _DATETIME_TYPES for c in type(value).__mro__)

ENCODABLE_DEPTH = 254
"""The deepest nesting of arrays and objects orjson encodes (it refuses a 255th level)."""

MAX_DEPTH = 128
"""The deepest nesting of arrays and objects a payload may have. A payload is stored wrapped:
inside its event's body, the sealed content, an Interaction's tool result, a snapshot of the
whole tree, a feed envelope, an HTTP answer. Each of those must still encode, so a payload
keeps ``ENCODABLE_DEPTH - MAX_DEPTH`` levels free for them (a payload of 248 levels passed,
then its event could not be encoded: the run's owner stopped)."""

_HEADROOM = ENCODABLE_DEPTH - MAX_DEPTH


def _within_depth(value: Any) -> bool:
    """Whether ``value`` nests at most ``MAX_DEPTH`` levels: orjson encodes it under
    ``_HEADROOM`` more (C speed; a walk in Python would cost a large payload milliseconds)."""
    wrapped = value
    for _ in range(_HEADROOM):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped, option=_OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True


def _too_deep(path: str) -> InvalidInput:
    return InvalidInput("payload.invalid", f"the value is nested deeper than {MAX_DEPTH} levels (at {path[:80]}...)",
                        hint=f"flatten the value to at most {MAX_DEPTH} levels of arrays and objects",
                        recorded_hint=False)


def _check(value: Any, path: str, depth: int = 0) -> None:
    # Walks the value once; orjson alone would silently turn NaN into null. ``depth``: the
    # arrays and objects around ``value``; one more at MAX_DEPTH is one level too many.
    if value is None or value is True or value is False:
        return
    if isinstance(value, str):
        _text(value, path)
        return
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise InvalidInput("payload.invalid", f"integer at {path} exceeds 64 bits",
                               hint="send a number this large as a string", recorded_hint=False)
        return
    if isinstance(value, _WRITTEN_BY_ORJSON) or _a_datetime(value):
        # Stored as the JSON orjson writes for it (ISO 8601 text, the UUID's text, the Enum's
        # value, the dataclass's fields), as without a null anywhere in the value, when this
        # walk does not run: accepted either way (it refused these only when a null was there).
        if isinstance(value, enum.Enum):
            _check(value.value, path, depth)
        return
    if depth >= MAX_DEPTH and (isinstance(value, (dict, list, tuple)) or dataclasses.is_dataclass(value)):
        raise _too_deep(path)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _check(getattr(value, field.name), f"{path}.{field.name}", depth + 1)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput("payload.invalid", f"non-finite number at {path}", hint=NON_FINITE_HINT,
                               recorded_hint=False)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput("payload.invalid", f"non-string object key at {path}",
                                   hint="JSON object keys are strings: convert the keys with str()",
                                   recorded_hint=False)
            _text(key, f"a key of {path}")
            _check(item, f"{path}.{key}", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]", depth + 1)
        return
    raise InvalidInput("payload.invalid", f"value of type {type(value).__name__} at {path} is not JSON",
                       hint="pass only dict, list, str, int, float, bool and None: convert the value first "
                       "(a set to a list, bytes to text)", recorded_hint=False)


def normalize(value: JSON, *, limit: int = MAX_PAYLOAD_BYTES, what: str = "payload") -> JSON:
    """Validate a JSON value and return its normalized form (fresh lists and dicts).

    Raises ``payload.invalid`` for non-JSON values and ``payload.too_large`` when the
    canonical encoding exceeds ``limit`` bytes.
    """
    if value is None or value is True or value is False or isinstance(value, str):
        if isinstance(value, str):
            _text(value, "$")  # orjson refuses a lone surrogate only when it encodes
        # A character encodes to at most 6 bytes (``\u0001``), so only a string longer than a
        # sixth of the limit can exceed it: shorter ones are not encoded at all.
        data = canonical_bytes(value) if isinstance(value, str) and len(value) > (limit - 2) // 6 else b""
    else:
        try:
            data = canonical_bytes(value)
        except (TypeError, orjson.JSONEncodeError):
            _check(value, "$")  # names the offending path
            raise InvalidInput("payload.invalid", f"{what} is not JSON",
                               hint="pass only dict, list, str, int, float, bool and None", recorded_hint=False) from None
        if b"null" in data:
            # orjson writes NaN and infinities as null; only then is a walk needed.
            _check(value, "$")
        if data.count(b"[") + data.count(b"{") > MAX_DEPTH and not _within_depth(value):
            # Enough brackets to nest that deep (strings hold some too): the walk names the path.
            _check(value, "$")
            raise InvalidInput("payload.invalid", f"{what} is nested deeper than {MAX_DEPTH} levels",
                               hint=f"flatten the value to at most {MAX_DEPTH} levels of arrays and objects",
                               recorded_hint=False)
    if len(data) > limit:
        raise InvalidInput(
            "payload.too_large",
            f"{what} is {len(data)} bytes, above the limit of {limit}",
            hint="send a smaller value or store large content elsewhere and pass a reference",
        )
    if isinstance(value, (dict, list, tuple)):
        return orjson.loads(data)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput("payload.invalid", "non-finite number at $", hint=NON_FINITE_HINT, recorded_hint=False)
    if type(value) not in (int, float, str, bool) and value is not None:
        # A datetime, UUID, Enum, dataclass (or a subclass of int or str) given alone: what is
        # stored, and what any fold after this one sees, is its JSON: the live run sees it too.
        return orjson.loads(data or canonical_bytes(value))
    return value


def parse_json_text(text: str | bytes, *, limit: int = MAX_PAYLOAD_BYTES, what: str = "payload") -> JSON:
    """Parse JSON text supplied by a caller, then normalize it."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    if len(raw) > limit * 4 + 1024:
        raise InvalidInput("payload.too_large", f"{what} text is {len(raw)} bytes, above the limit")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput("payload.invalid", f"{what} is not valid JSON: {exc}",
                           hint="send JSON text (RFC 8259): double-quoted strings and keys, no trailing commas, "
                           "no NaN or infinity", recorded_hint=False) from exc
    return exactly(raw, value, limit=limit, what=what)


def exactly(raw: bytes | str, value: JSON, *, limit: int = MAX_PAYLOAD_BYTES, what: str = "payload") -> JSON:
    """``value`` (what orjson parsed from ``raw``) checked against an exact reading of ``raw``, then
    normalized: ``InvalidInput`` for a key written twice, an integer beyond 64 bits, or nesting
    beyond ``MAX_DEPTH``."""
    # Read once more by the standard library, exactly: it sees a key written twice (orjson
    # keeps the last one), and an integer beyond 64 bits, which orjson reads as a float
    # (precision lost, silently), stays an integer that normalize refuses by its path.
    try:
        exact = json.loads(raw, object_pairs_hook=_unique_pairs, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidInput("payload.invalid", f"{what} is nested deeper than {MAX_DEPTH} levels",
                           hint=f"flatten the value to at most {MAX_DEPTH} levels of arrays and objects",
                           recorded_hint=False) from None
    duplicate = _first_repeated(exact)
    if duplicate is not None:
        raise InvalidInput("payload.invalid", f"{what}: {duplicate[0]} has the key {duplicate[1]!r} twice",
                           hint="JSON parsers keep only the last one, silently; write each key once")
    return normalize(exact if _holds_float(value) else value, limit=limit, what=what)


class _Repeated(dict[str, Any]):
    """An object whose text holds ``key`` twice (what ``duplicate_key`` looks for)."""

    key: str


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) == len(pairs):
        return value
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            repeated = _Repeated(value)
            repeated.key = key
            return repeated
        seen.add(key)
    return value  # pragma: no cover - unreachable: a shorter dict has a repeated key


def duplicate_key(raw: str | bytes) -> tuple[str, str] | None:
    """Where valid JSON text ``raw`` has a key twice in one object: (the object's JSON path,
    the key), the first in document order; None when every object's keys are distinct.

    Parsers (orjson, the standard library, pydantic) keep the last of two equal keys
    without a word; text a person wrote with a key twice almost always means a mistake.

    The cost is one parse plus, only when some object repeats a key, one walk that builds
    no path but the one it reports: a 16 MiB body of a million values is no slower to
    check than to parse (a path string per value made it take seconds and gigabytes)."""
    repeated: list[_Repeated] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(items)
        if len(value) == len(items):
            return value
        marked = _unique_pairs(items)
        repeated.append(marked)  # type: ignore[arg-type]  # a shorter dict is always marked
        return marked

    try:
        value = json.loads(raw, object_pairs_hook=pairs, parse_constant=lambda name: None)
    except (ValueError, RecursionError):
        return None  # not this check's concern: the caller's parser reports invalid JSON
    return _first_repeated(value) if repeated else None


def _first_repeated(value: Any) -> tuple[str, str] | None:
    """The first object (from the outside in, in document order) marked by ``_unique_pairs``.

    A depth-first walk over iterators: it holds one iterator per level and the keys that
    lead to the current container, and formats a path only for the object it reports."""
    if isinstance(value, _Repeated):
        return "$", value.key
    keys: list[str | int] = []
    stack: list[Iterator[tuple[str | int, Any]]] = [_members(value)]
    while stack:
        for key, item in stack[-1]:
            if isinstance(item, _Repeated):
                return _path([*keys, key]), item.key
            if item and isinstance(item, (dict, list)):
                keys.append(key)
                stack.append(_members(item))
                break
        else:
            stack.pop()
            if keys:
                keys.pop()
    return None


def _members(value: Any) -> Iterator[tuple[str | int, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    if isinstance(value, list):
        return enumerate(value)
    return iter(())


def _path(keys: Sequence[str | int]) -> str:
    """``$.a[0].b`` for keys ``a``, ``0``, ``b`` (an int is an array index)."""
    return "$" + "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in keys)


def _no_constant(name: str) -> Any:
    raise InvalidInput("payload.invalid", f"{name} is not a JSON number", hint=NON_FINITE_HINT, recorded_hint=False)


def _holds_float(value: JSON) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def value_at(value: JSON, path: Sequence[str]) -> tuple[bool, JSON]:
    """``(True, value[path[0]][path[1]]...)``, or ``(False, None)`` when a key is missing."""
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value
