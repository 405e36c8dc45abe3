"""The pure side of a ToolSet and of Delegates: what scheduling may know about tools.

A :class:`ToolSpec` carries a tool's model-visible definition (name, description,
parameters schema) and its frozen scheduling declarations: deferred, direct result,
and an optional pure concurrency classifier. Executable tools live in ``adapters``;
the Interaction never holds them.

A :class:`DelegateSpec` binds a model-visible name to one exact child Program with
its grant, capabilities and a pure function turning the call's arguments into the
child's input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from agentfold.domain.budget import Budget
from agentfold.domain.canonical import JSON, exactly
from agentfold.domain.errors import InvalidInput
from agentfold.domain.interaction.chat import ToolCall
from agentfold.domain.json_schema import check_schema, schema_errors
from agentfold.domain.program import Program

Classifier = Callable[[ToolCall, JSON], tuple[str, bool]]
"""``(call, arguments) -> (key, concurrent)``: pure, deterministic, bounded."""


def check_name(name: str, what: str) -> None:
    """A tool's or a Delegate's name as models accept it (interaction.toolset.invalid)."""
    if not isinstance(name, str) or not name or len(name) > 128 or not all(c.isalnum() or c in "_-." for c in name):
        raise InvalidInput("interaction.toolset.invalid", f"{what} name {name!r} must be 1-128 of [A-Za-z0-9_.-]")


def _check_description(text: str, what: str) -> None:
    if not isinstance(text, str) or text != text.strip() or len(text.encode()) > 4096:
        raise InvalidInput(
            "interaction.toolset.invalid", f"{what} description must be trimmed UTF-8 of at most 4096 bytes"
        )


@dataclass(frozen=True, eq=False)
class ToolSpec:
    name: str
    description: str = ""
    parameters: JSON = field(default_factory=lambda: {"type": "object"})
    direct_result: bool = False
    concurrency: Classifier | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "tool")
        _check_description(self.description, f"tool {self.name}")
        check_schema(self.parameters, f"#tool:{self.name}")

    def definition(self) -> dict[str, JSON]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def prepare(self, call: ToolCall, *, exact: bool = True) -> tuple[JSON, str | None]:
        """Parse and validate the call's arguments: ``(arguments, None)`` or ``(None, reason)``
        (``exact``: see ``prepare_arguments``)."""
        return prepare_arguments(call.arguments, self.parameters, exact=exact)

    def classify(self, call: ToolCall) -> tuple[str, bool]:
        """``(key, concurrent)``; calls without a policy or with bad arguments run alone."""
        if self.concurrency is None:
            return "", False
        arguments, problem = self.prepare(call)
        if problem is not None:
            return "", False
        key, concurrent = self.concurrency(call, arguments)
        return str(key), bool(concurrent)


def prepare_arguments(text: str, schema: JSON, *, exact: bool = True) -> tuple[JSON, str | None]:
    """A call's arguments parsed and checked against ``schema``: ``(arguments, None)`` or
    ``(None, what is wrong)``.

    Read exactly, as a host's JSON text is (``canonical.exactly``): orjson alone reads an integer
    beyond 64 bits as a float (precision lost, silently: 2**64 + 1 reached the tool as
    1.8446744073709552e+19 and passed ``{"type": "integer"}``) and keeps the last of a key
    written twice. ``exact=False`` reads as releases before 2026-12-05 did (orjson alone), for a
    call such a release may have run (the resolution of its unknown outcome)."""
    raw = text.strip() if text else ""
    if not raw:
        value: JSON = {}
    else:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return None, f"arguments are not valid JSON: {exc}"
        if exact:
            try:
                value = exactly(raw, value, what="arguments")
            except InvalidInput as exc:
                return None, exc.message
    problems = schema_errors(value, schema)
    if problems:
        return None, "; ".join(problems[:3])
    return value, None


@dataclass(frozen=True, eq=False)
class DelegateSpec:
    """A model-selectable, exact child Program (a Delegate)."""

    name: str
    description: str
    input_schema: JSON
    program: Program
    budget: Budget = field(default_factory=Budget)
    capabilities: frozenset[str] = frozenset()
    build_input: Callable[[JSON], JSON] | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "delegate")
        _check_description(self.description, f"delegate {self.name}")
        if not isinstance(self.input_schema, dict) or self.input_schema.get("type") != "object":
            raise InvalidInput("interaction.delegate.invalid", f"delegate {self.name} needs an object input schema")
        check_schema(self.input_schema, f"#delegate:{self.name}")

    def definition(self) -> dict[str, JSON]:
        return {"name": self.name, "description": self.description, "parameters": self.input_schema}

    def child_input(self, arguments: JSON) -> JSON:
        return self.build_input(arguments) if self.build_input is not None else arguments


@dataclass(frozen=True, eq=False)
class ToolManifest:
    """The ordinary and deferred tools of one ToolSet, plus the Delegates of an Interaction."""

    tools: tuple[ToolSpec, ...] = ()
    deferred: tuple[ToolSpec, ...] = ()
    delegates: tuple[DelegateSpec, ...] = ()
    _by_name: dict[str, ToolSpec] = field(init=False, repr=False)
    _delegates: dict[str, DelegateSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_name: dict[str, ToolSpec] = {}
        for spec in (*self.tools, *self.deferred):
            if spec.name in by_name:
                raise InvalidInput("interaction.toolset.invalid", f"tool name {spec.name!r} is bound twice")
            by_name[spec.name] = spec
        delegates: dict[str, DelegateSpec] = {}
        for delegate in self.delegates:
            if delegate.name in by_name or delegate.name in delegates:
                raise InvalidInput(
                    "interaction.delegate.invalid", f"delegate name {delegate.name!r} collides with another binding"
                )
            delegates[delegate.name] = delegate
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_delegates", delegates)

    @property
    def configured(self) -> bool:
        return bool(self._by_name)

    def tool(self, name: str) -> ToolSpec | None:
        return self._by_name.get(name)

    def delegate(self, name: str) -> DelegateSpec | None:
        return self._delegates.get(name)

    def deferred_names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.deferred)

    def is_deferred(self, name: str) -> bool:
        return any(s.name == name for s in self.deferred)

    def definitions(self, advertised: Sequence[str]) -> list[dict[str, JSON]]:
        """Model-visible definitions: initial tools, then Delegates, then advertised deferred tools."""
        out = [s.definition() for s in self.tools]
        out += [d.definition() for d in self.delegates]
        for name in advertised:
            spec = self._by_name.get(name)
            if spec is not None and self.is_deferred(name):
                out.append(spec.definition())
        return out

    def tool_window(self, calls: Sequence[ToolCall], cursor: int, max_concurrent: int) -> int:
        """The number of consecutive calls from ``cursor`` that form one Tool window (spec 3.4)."""
        if max_concurrent <= 1:
            return 1  # every window is one call; no classifier runs (Scope: concurrentBatchEnd only above 1)
        keys: set[str] = set()
        size = 0
        for i in range(cursor, len(calls)):
            spec = self._by_name.get(calls[i].name)
            if spec is None:
                break
            key, concurrent = spec.classify(calls[i])
            if not concurrent:
                if i == cursor:
                    return 1
                break
            if key:
                if key in keys:
                    break
                keys.add(key)
            size += 1
        return max(size, 1)


def result_text_output(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}]}
