"""``replace``: ``dataclasses.replace`` for the frozen, slotted state records of hot paths.

An Interaction round changes its state ~24 times (each op returns a new
``InteractionState``, ``Round``, ``Batch`` or ``Invocation``). ``dataclasses.replace``
looks the class's fields up and validates them on every call (~2.9 us for
``InteractionState``); the function generated here once per class copies the slots
straight (~1.0 us), the same result: every field not named keeps its value, an unknown
name is a ``TypeError``. A class this does not fit (not a frozen slotted dataclass, a
``__post_init__``, an ``InitVar`` or a field outside ``__init__``) gets
``dataclasses.replace`` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_REPLACERS: dict[type, Callable[..., Any]] = {}
_UNSET = object()


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of ``obj`` with ``changes`` (as ``dataclasses.replace``)."""
    replacer = _REPLACERS.get(type(obj))
    if replacer is None:
        replacer = _REPLACERS[type(obj)] = _replacer(type(obj))
    return replacer(obj, **changes)  # type: ignore[no-any-return]


def _replacer(cls: type) -> Callable[..., Any]:
    params = getattr(cls, "__dataclass_params__", None)
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    names = tuple(f.name for f in fields)
    if (
        params is None
        or not params.frozen
        or getattr(cls, "__slots__", None) != names
        or hasattr(cls, "__post_init__")
        or any(not f.init or f._field_type is not dataclasses._FIELD for f in fields)  # type: ignore[attr-defined]
        or any(not n.isidentifier() for n in names)
    ):
        return dataclasses.replace
    arguments = ", ".join(f"{n}=_UNSET" for n in names)
    body = "".join(f"    _set(new, {n!r}, obj.{n} if {n} is _UNSET else {n})\n" for n in names)
    source = f"def replace(obj, /, *, {arguments}):\n    new = _new(_cls)\n{body}    return new\n"
    namespace: dict[str, Any] = {"_UNSET": _UNSET, "_new": object.__new__, "_cls": cls, "_set": object.__setattr__}
    exec(source, namespace)
    replacer: Callable[..., Any] = namespace["replace"]
    return replacer


__all__ = ["replace"]
