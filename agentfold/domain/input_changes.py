"""A child's input stored as its changes from an earlier child's input (pure).

A Process that starts children with growing inputs (a team's coordinator turn n gets every
task so far: Scope's Turn is cumulative) stored each whole input again, so its history grew
with the square of the number of starts. A start-child Effect may name an earlier child of
the same parent whose input the new one is close to (``start_child_effect(...,
input_like=key)``); the kernel then stores, in place of ``input``,

    "input_patch": {"base": "<that child's key>", "ops": [<op>, ...]}

and the fold rebuilds the input from the base child's input. Ops apply in order; a path
is a list of object member names (strings) and array indexes (integers ≥ 0):

* ``{"op": "set", "path": p, "value": v}``: the value at ``p`` becomes ``v`` (an object
  member is added or replaced; an array index equal to the array's length appends; ``[]``
  replaces the whole input);
* ``{"op": "drop", "path": p}``: the object member at ``p`` is removed;
* ``{"op": "cut", "path": p, "length": n}``: the array at ``p`` keeps its first ``n`` items.

The kernel stores the changes only when they rebuild exactly the input (canonical JSON) and
are shorter than it; otherwise the input is stored whole, as before.
"""

from __future__ import annotations

import math
from typing import Any

from agentfold.domain.canonical import JSON, canonical_bytes

INPUT_PATCH = "input_patch"


class UnreadPatch(dict[str, Any]):
    """A version-1 ``start_child`` payload that happens to hold an ``input_patch`` member and no
    ``input`` (a Step's own member, before 2026-12-05, which releases then kept unread): decoded
    as this type, it is read as it was then (no input), and stays version 1."""


def holds_input_patch(target: Any, payload: Any) -> bool:
    """Whether an ``EffectDeclared`` stores its child's input as changes (schema version 2): a
    framework ``start_child`` payload with ``input_patch`` and without ``input``. Any other
    payload holding an ``input_patch`` member is what older releases stored too (a framework
    payload's unknown members were kept, unread): read as it always was. The decoder marks a
    version-1 payload of this shape as :class:`UnreadPatch` (not a ``dict`` here)."""
    return (
        target == "framework"
        and type(payload) is dict
        and INPUT_PATCH in payload
        and "input" not in payload
        and payload.get("operation") == "start_child"
    )


def input_changes(base: JSON, new: JSON, base_key: str) -> dict[str, JSON] | None:
    """The ``input_patch`` member that stores ``new`` as changes from ``base``, or None when
    storing ``new`` whole is as short (or the changes would not rebuild it exactly)."""
    ops: list[JSON] = []
    _diff(base, new, [], ops)
    patch: dict[str, JSON] = {"base": base_key, "ops": ops}
    whole = canonical_bytes(new)
    if len(canonical_bytes(patch)) >= len(whole):
        return None
    try:
        rebuilt = apply_changes(base, ops)
    except ValueError:  # pragma: no cover - the ops above always apply to their base
        return None
    return patch if canonical_bytes(rebuilt) == whole else None


def _diff(old: Any, new: Any, path: list[JSON], ops: list[JSON]) -> None:
    if type(old) is dict and type(new) is dict:
        for key in old:
            if key not in new:
                ops.append({"op": "drop", "path": [*path, key]})
        for key, value in new.items():
            if key in old:
                _diff(old[key], value, [*path, key], ops)
            else:
                ops.append({"op": "set", "path": [*path, key], "value": value})
    elif type(old) is list and type(new) is list:
        if len(new) < len(old):
            ops.append({"op": "cut", "path": list(path), "length": len(new)})
        shared = min(len(old), len(new))
        for index in range(shared):
            _diff(old[index], new[index], [*path, index], ops)
        for index in range(shared, len(new)):
            ops.append({"op": "set", "path": [*path, index], "value": new[index]})
    elif type(old) is not type(new) or old != new or (
        type(old) is float and math.copysign(1.0, old) != math.copysign(1.0, new)  # 0.0 and -0.0 differ in JSON
    ):
        ops.append({"op": "set", "path": list(path), "value": new})


def apply_changes(base: JSON, ops: Any) -> JSON:
    """``base`` with ``ops`` applied, its objects' members in key order (as decoding the stored
    input would give them). ``base`` is left unchanged: every array and object on an op's path
    is copied once, and what no op touches is shared with it (a Turn repeats the one before:
    copying it all made folding a team's history quadratic again). Raises ``ValueError``
    naming the first op that is not one or does not apply."""
    if not isinstance(ops, list):
        raise ValueError(f"ops must be a list, not {type(ops).__name__}")
    root: list[Any] = [base]
    copied: dict[int, Any] = {}  # the containers this apply copied (and may change), by id
    for number, op in enumerate(ops):
        if not isinstance(op, dict) or not isinstance(op.get("path"), list):
            raise ValueError(f"op {number} is not an object with a path list")
        kind, path = op.get("op"), op["path"]
        members = {"set": {"op", "path", "value"}, "drop": {"op", "path"}, "cut": {"op", "path", "length"}}.get(
            kind if isinstance(kind, str) else "")
        if members is None or set(op) != members:
            raise ValueError(f"op {number} is not a set, drop or cut op with exactly its members")
        target = path if kind == "cut" else path[:-1]
        holder: Any = root
        at: Any = 0
        for step in target:
            holder, at = _enter(holder, at, step, copied, number)
        if kind == "cut":
            items = _copy(holder, at, copied)
            length = op["length"]
            if not isinstance(items, list) or type(length) is not int or not 0 <= length <= len(items):
                raise ValueError(f"op {number} cuts {_shown(path)}, which is no array of at least that length")
            del items[length:]
            continue
        if not path:
            if kind == "drop":
                raise ValueError(f"op {number} drops the whole input")
            root[0] = op["value"]
            continue
        container = _copy(holder, at, copied)
        last = path[-1]
        if isinstance(container, dict) and type(last) is str:
            if kind == "drop":
                if last not in container:
                    raise ValueError(f"op {number} drops {_shown(path)}, which is not there")
                del container[last]
            else:
                container[last] = op["value"]
        elif isinstance(container, list) and type(last) is int and kind == "set" and 0 <= last <= len(container):
            if last == len(container):
                container.append(op["value"])
            else:
                container[last] = op["value"]
        else:
            raise ValueError(f"op {number} does not apply at {_shown(path)}")
    for container in copied.values():
        if isinstance(container, dict) and list(container) != sorted(container):
            ordered = sorted(container.items())
            container.clear()
            container.update(ordered)
    return root[0]


def with_whole_input(payload: dict[str, Any], base_input: JSON) -> dict[str, Any]:
    """A start-child payload holding ``input_patch``, with ``input`` rebuilt from ``base_input``
    (the input of the child its ``base`` names) in its place. Raises ``ValueError`` as
    :func:`apply_changes` does."""
    whole = {k: v for k, v in payload.items() if k != INPUT_PATCH}
    whole["input"] = apply_changes(base_input, payload[INPUT_PATCH].get("ops"))
    return whole


def _copy(holder: Any, at: Any, copied: dict[int, Any]) -> Any:
    """The container at ``holder[at]``, replaced there by a copy the first time this apply meets it."""
    value = holder[at]
    if isinstance(value, (dict, list)) and id(value) not in copied:
        value = dict(value) if isinstance(value, dict) else list(value)
        holder[at] = value
        copied[id(value)] = value
    return value


def _enter(holder: Any, at: Any, step: Any, copied: dict[int, Any], number: int) -> tuple[Any, Any]:
    container = _copy(holder, at, copied)
    if isinstance(container, dict) and type(step) is str and step in container:
        return container, step
    if isinstance(container, list) and type(step) is int and 0 <= step < len(container):
        return container, step
    raise ValueError(f"op {number}'s path goes through {step!r}, which is not there")


def _shown(path: list[Any]) -> str:
    return "/" + "/".join(str(p) for p in path)


__all__ = ["INPUT_PATCH", "UnreadPatch", "apply_changes", "holds_input_patch", "input_changes", "with_whole_input"]
