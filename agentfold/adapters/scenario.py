"""Scenario files: a JSON description of an Interaction run with a scripted model and tools.

The format is documented in docs/scenarios.md. A scenario is validated completely
before anything runs; a fault is refused with the JSON path where it lies
(``scenario.invalid``, e.g. ``$.tools[1].result.failure.kind``). The normalized
scenario is stored with the tree (``TreeStarted.configuration``) and its digest is in
the ProgramRef, so every later command rebuilds the exact Program without the file.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import os
import stat
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.tools import ToolFailure, ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.budget import Budget, child_debit
from agentfold.domain.canonical import JSON, digest_of, duplicate_key, normalize
from agentfold.domain.errors import InvalidInput
from agentfold.domain.interaction.chat import FINISH_REASONS, ChatInput, parse_response
from agentfold.domain.interaction.toolset import check_name
from agentfold.domain.json_schema import accepts_nothing, check_schema
from agentfold.domain.program import Program

PROGRAM_NAME = "agentfold.scenario"


#: At most this many faults are listed in a refusal's ``faults`` (``fault_count`` says how many
#: there were), and the first ``MESSAGE_FAULTS`` of them in its message.
MAX_FAULTS = 20
MESSAGE_FAULTS = 5


class ScenarioError(InvalidInput):
    """``scenario.invalid``: ``path`` is the first fault's JSON path, ``faults`` every fault found
    (``[{"path", "message"}]``, at most ``MAX_FAULTS``) and ``fault_count`` how many there were."""

    def __init__(self, path: str, message: str, *, more: Sequence[tuple[str, str]] = (), count: int = 0) -> None:
        found = [(path, message), *more]
        count = max(count, len(found))
        text = f"{path}: {message}"
        if count > 1:
            listed = "; ".join(f"{p}: {m}" for p, m in found[1:MESSAGE_FAULTS])
            text += f" (and {count - 1} more fault{'s' if count > 2 else ''}: {listed}"
            if count > MAX_FAULTS:
                text += f"; ... {count - MESSAGE_FAULTS} more, {MAX_FAULTS - MESSAGE_FAULTS} of them listed in faults)"
            elif count > MESSAGE_FAULTS:
                text += f"; ... {count - MESSAGE_FAULTS} more listed in faults)"
            else:
                text += ")"
        super().__init__(
            "scenario.invalid", text, hint="fix the scenario document", path=path,
            faults=[{"path": p, "message": m} for p, m in found[:MAX_FAULTS]], fault_count=count,
        )

    def found(self) -> list[tuple[str, str]]:
        """Every fault this refusal lists (the first ``MAX_FAULTS``), as (path, message)."""
        return [(f["path"], f["message"]) for f in self.details["faults"]]


class _Faults:
    """Collects the faults of a scenario's independent parts (each model response, tool,
    Delegate, ...), so that one refusal names them all, not only the first."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []
        self.count = 0

    def add(self, path: str, message: str) -> None:
        if len(self.found) < MAX_FAULTS:  # the rest are only counted
            self.found.append((path, message))
        self.count += 1

    @property
    def full(self) -> bool:
        """Whether a refusal lists no more faults: a costlier message is not worth making."""
        return len(self.found) >= MAX_FAULTS

    def part(self) -> _Faults:
        """Check one part (``with faults.part(): ...``); a fault in it is kept and the checks go
        on with the next part. (A plain context manager: a scenario of thousands of tools has
        several parts per tool.)"""
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if not isinstance(exc, ScenarioError):
            return False
        self.found.extend(exc.found()[: MAX_FAULTS - len(self.found)])
        self.count += exc.details["fault_count"]
        return True

    def error(self) -> ScenarioError | None:
        """One ScenarioError for every fault kept; None without any."""
        if not self.found:
            return None
        (path, message), *more = self.found
        return ScenarioError(path, message, more=more, count=self.count)

    def refuse(self) -> None:
        """Raise one ScenarioError for every fault kept, if any."""
        error = self.error()
        if error is not None:
            raise error


def _obj(
    value: Any, path: str, required: Sequence[str] = (), optional: Sequence[str] = (), faults: _Faults | None = None
) -> dict[str, Any]:
    """``value`` as an object with these members. Every member missing and every unknown one
    is a fault; an unknown member goes to ``faults`` (when given) and the object is returned,
    a missing one (or no object at all) is raised: its parts are not looked into."""
    if not isinstance(value, dict):
        raise ScenarioError(path, "must be an object")
    missing, unknown = _member_faults(value, path, required, optional, faults)
    if missing or (unknown and faults is None):
        (first, message), *more = missing + unknown
        raise ScenarioError(first, message, more=more)
    for where, message in unknown:
        faults.add(where, message)  # type: ignore[union-attr]  # None raised above
    return value


def _member_faults(
    value: dict[str, Any], path: str, required: Sequence[str], optional: Sequence[str], faults: _Faults | None
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The members of object ``value`` that are missing, and those that are unknown (the first
    few with the member each may be a misspelling of, while ``faults`` lists more)."""
    allowed = (*required, *optional)
    missing = [(f"{path}.{name}", "is required") for name in required if name not in value]
    unknown = [
        (f"{path}.{_shown(name)}", _not_a_member(name, allowed, value) if i < MESSAGE_FAULTS and not (faults and faults.full)
         else "is not a scenario member")
        for i, name in enumerate(sorted(set(value) - set(allowed)))
    ]
    return missing, unknown


def _shown(name: str) -> str:
    """A member name as a fault's path shows it: a long one cut (a refusal stays small)."""
    return name if len(name) <= 80 else name[:80] + "..."


def _not_a_member(name: str, allowed: Sequence[str], present: Mapping[str, Any], what: str = "a scenario member") -> str:
    """"is not a scenario member", with the member it may be a misspelling of."""
    near = difflib.get_close_matches(name[:80], [a for a in allowed if a not in present], n=1, cutoff=0.75)
    return f"is not {what}" + (f" (did you mean {near[0]!r}?)" if near else "")


def _check_schema(schema: Any, path: str) -> None:
    """Check a scenario's JSON Schema completely, as the run will use it: ``check_schema``
    refuses what the validator does not enforce, a ``$ref`` that names no schema in it, and a
    chain of in-place keywords (``$ref``, ``allOf``, ...) that leads back to itself. Either
    fault would otherwise show only when the run is under way."""
    try:
        check_schema(schema, "#")
    except InvalidInput as exc:
        raise ScenarioError(path, exc.message) from exc


RESULT_FORMS = ("output", "echo", "failure", "error", "input", "cases")


def _check_result(value: Any, path: str, faults: _Faults, *, answer_allowed: bool = False) -> None:
    """One tool result (``RESULT`` of docs/scenarios.md); each case and each branch of it is
    checked as a part of its own."""
    if not isinstance(value, dict) or not value:
        raise ScenarioError(path, "a result is an object with one of output, echo, failure, error, input, cases")
    keys = set(value)
    if keys == {"output"}:
        return
    if keys == {"echo"}:
        if value["echo"] is not True:
            raise ScenarioError(f"{path}.echo", "must be true")
        return
    if keys == {"answer"} and answer_allowed:
        if value["answer"] is not True:
            raise ScenarioError(f"{path}.answer", "must be true")
        return
    if keys == {"failure"}:
        failure = _obj(value["failure"], f"{path}.failure", ("kind", "output"), (), faults)
        with faults.part():
            if failure["kind"] not in ("failed", "rejected"):
                raise ScenarioError(f"{path}.failure.kind", "must be failed or rejected")
        if not isinstance(failure["output"], str):
            raise ScenarioError(f"{path}.failure.output", "must be a string")
        return
    if keys == {"error"}:
        if not isinstance(value["error"], str):
            raise ScenarioError(f"{path}.error", "must be a string")
        return
    if keys == {"input", "then"}:
        with faults.part():
            spec = _obj(value["input"], f"{path}.input", ("prompt", "response_schema"), (), faults)
            _check_schema(spec["response_schema"], f"{path}.input.response_schema")
            if accepts_nothing(spec["response_schema"]):
                raise ScenarioError(f"{path}.input.response_schema", "accepts no answer: the tool's wait could only "
                                    "be canceled (true or {} accepts any)")
        _check_result(value["then"], f"{path}.then", faults, answer_allowed=True)
        return
    if keys <= {"cases", "otherwise"} and "cases" in keys:
        if not isinstance(value["cases"], list):
            raise ScenarioError(f"{path}.cases", "must be a list")
        for i, case in enumerate(value["cases"]):
            with faults.part():
                case = _obj(case, f"{path}.cases[{i}]", ("when", "result"), (), faults)
                with faults.part():
                    if not isinstance(case["when"], dict):
                        raise ScenarioError(f"{path}.cases[{i}].when", "must be an object")
                _check_result(case["result"], f"{path}.cases[{i}].result", faults, answer_allowed=answer_allowed)
        if "otherwise" in value:
            _check_result(value["otherwise"], f"{path}.otherwise", faults, answer_allowed=answer_allowed)
        elif not value["cases"]:
            # No case and nothing otherwise: every call would raise and become unknown.
            raise ScenarioError(f"{path}.cases", "is empty and there is no otherwise: no call could have a result")
        return
    forms = (*RESULT_FORMS, "answer") if answer_allowed else RESULT_FORMS
    if keys == {"answer"}:
        raise ScenarioError(f"{path}.answer", "is allowed only below a then (it returns the answer to the input "
                            "asked before it)")
    partner = {"input": "then", "then": "input", "otherwise": "cases"}
    if len(keys) == 1 and next(iter(keys)) in partner:
        (key,) = keys
        raise ScenarioError(path, f"has {key} without {partner[key]}: they go together")
    if len(keys) == 1:
        (key,) = keys
        named = "is not a result form" if faults.full else _not_a_member(key, forms, {}, "a result form")
        raise ScenarioError(f"{path}.{_shown(key)}", named +
                            f": a result is an object with one of {', '.join(forms)}")
    raise ScenarioError(path, f"has the members {', '.join(sorted(keys))}: a result has exactly one form (output, "
                        "echo, failure, error, input with then, or cases with an optional otherwise)")


SCENARIO_MEMBERS = ("input", "tools", "delegates", "limits", "side_effect_log", "description", "tool_budget")


def validate_scenario(
    doc: Any, path: str = "$", base_dir: Path | None = None, budget: Budget | None = None
) -> dict[str, Any]:
    """Validate a scenario document; return its normalized form (side_effect_log made absolute).
    ``path`` other than ``$`` is a nested scenario's, inside a document normalized already.

    Every part is checked (each model response, tool, Delegate, nested scenario, the limits,
    ...) and one ``scenario.invalid`` names all the faults found, the first as its ``path``.
    A part whose own form is wrong (not an object, a member missing) is not looked into further.

    ``budget``: the Budget the scenario's Interaction runs with (a Delegate's ``budget``;
    a root run's is unlimited). Each Tool child and Delegate child is granted its budget
    out of it, so a grant the kernel would refuse at the first call is refused here.
    """
    if not isinstance(doc, dict):
        raise ScenarioError(path, "must be an object")
    if path == "$":
        # Normalized first (a fresh copy: the caller's document is not changed), once for the
        # whole document with its nested scenarios: a value that is no JSON (a lone surrogate,
        # a NaN: a Python caller's document) would break a check below with a bare TypeError.
        try:
            doc = normalize(doc, what="scenario")
        except InvalidInput as exc:
            raise ScenarioError(path, exc.message) from exc
        assert isinstance(doc, dict)
    faults = _Faults()
    # Unlike a part's, the document's own missing members stop nothing: the rest is checked.
    missing, unknown = _member_faults(doc, path, ("name", "model"), SCENARIO_MEMBERS, faults)
    for where, message in missing + unknown:
        faults.add(where, message)
    with faults.part():
        if "name" in doc and (not isinstance(doc["name"], str) or not doc["name"]):
            raise ScenarioError(f"{path}.name", "must be a non-empty string")
    with faults.part():
        _check_description(doc, path)
    lists: dict[str, list[Any]] = {}
    for member in ("tools", "delegates"):
        with faults.part():
            if member in doc and not isinstance(doc[member], list):
                raise ScenarioError(f"{path}.{member}", "must be a list (of objects)")
            lists[member] = doc.get(member, [])
    tools, delegates = lists.get("tools", []), lists.get("delegates", [])
    # A tools or delegates member that is no list is one fault: the rules that depend on
    # whether there are tools (tool_budget, limits) are not judged against it.
    unsure = len(lists) < 2
    if "input" in doc:
        with faults.part():
            given = _obj(doc["input"], f"{path}.input", ("messages",), ("options",), faults)
            try:
                ChatInput.parse({k: v for k, v in given.items() if k in ("messages", "options")}, f"{path}.input")
            except InvalidInput as exc:
                raise _at_its_path(exc, f"{path}.input") from exc
    if "model" in doc:
        with faults.part():
            model = _obj(doc["model"], f"{path}.model", ("responses",), (), faults)
            if not isinstance(model["responses"], list):
                raise ScenarioError(f"{path}.model.responses", "must be a list")
            for i, response in enumerate(model["responses"]):
                with faults.part():
                    _check_response(response, f"{path}.model.responses[{i}]", faults)
    names: set[str] = set()
    checked: dict[int, dict[str, Any]] = {}  # the tools whose own form is right, by index
    for i, tool in enumerate(tools):
        with faults.part():
            checked[i] = _check_tool(tool, f"{path}.tools[{i}]", names, faults)
    own = budget if budget is not None else Budget()
    with faults.part():
        if "tool_budget" in doc:
            if not tools and not unsure:
                raise ScenarioError(f"{path}.tool_budget", "is granted to each Tool child: give it only with tools")
            _grant(own, doc["tool_budget"], f"{path}.tool_budget", "each Tool child")
        elif tools:
            _grant(own, None, f"{path}.tool_budget", "each Tool child")
    # Every tool that says it is deferred (a tool at fault too: its own fault is named, not again
    # in each tool that advertises it).
    deferred = {t["name"] for t in tools
                if isinstance(t, dict) and isinstance(t.get("name"), str) and t.get("deferred", False) is not False}
    for i, tool in checked.items():
        advertises = tool.get("advertises", [])
        for j, name in enumerate(advertises if isinstance(advertises, list) else []):
            with faults.part():
                if isinstance(name, str) and name not in deferred:
                    raise ScenarioError(f"{path}.tools[{i}].advertises[{j}]", f"{name!r} is not a deferred tool")
    for i, delegate in enumerate(delegates):
        with faults.part():
            _check_delegate(delegate, f"{path}.delegates[{i}]", names, own, base_dir, faults)
    with faults.part():
        _check_limits(doc, path, bool(tools or delegates or unsure), faults)
    if "side_effect_log" in doc:
        with faults.part():
            doc = {**doc, "side_effect_log": _side_effect_log(doc["side_effect_log"], f"{path}.side_effect_log", base_dir)}
    faults.refuse()
    return doc  # type: ignore[no-any-return]


MESSAGE_MEMBERS = ("content", "tool_calls", "role")


def _check_response(response: Any, where: str, faults: _Faults) -> None:
    """One scripted model response (``$.model.responses[i]``)."""
    if isinstance(response, dict) and "error" in response:
        _obj(response, where, ("error",), (), faults)  # an error response: other members are faults
        if not isinstance(response["error"], str):
            raise ScenarioError(f"{where}.error", "must be a string")
        return
    response = _obj(response, where, ("finish_reason", "message"), ("usage",), faults)
    message = _obj(response["message"], f"{where}.message", (), MESSAGE_MEMBERS, faults)
    message = {k: v for k, v in message.items() if k in MESSAGE_MEMBERS}  # an unknown one is a fault already
    try:
        parse_response({"message": {"role": "assistant", **message}, "finish_reason": response["finish_reason"],
                        **({"usage": response["usage"]} if "usage" in response else {})}, where)
    except InvalidInput as exc:
        raise _at_its_path(exc, where) from exc
    if response["finish_reason"] not in FINISH_REASONS:
        # The model dispatcher would leave that call unknown: refused here, before the run.
        raise ScenarioError(f"{where}.finish_reason",
                            f"{response['finish_reason']!r} is not one of {', '.join(FINISH_REASONS)}")


def _at_its_path(exc: InvalidInput, where: str) -> ScenarioError:
    """A parser's refusal of the part at ``where``, as the fault at the path it names (its
    message starts with that path already: ``$.model.responses[0].message...: ...``)."""
    inner = str(exc.details.get("path") or "")
    if inner.startswith(where) and exc.message.startswith(f"{inner}: "):
        return ScenarioError(inner, exc.message[len(inner) + 2:])
    return ScenarioError(where, exc.message)


def _check_tool(value: Any, where: str, names: set[str], faults: _Faults) -> dict[str, Any]:
    """One scripted tool (``$.tools[i]``): its name joins ``names``; the faults of its members
    go to ``faults``; returned when its own form (an object with a unique name) is right."""
    tool = _obj(
        value, where, ("name", "result"),
        ("description", "parameters", "concurrency", "direct_result", "deferred", "advertises"), faults,
    )
    if not isinstance(tool["name"], str) or not tool["name"] or tool["name"] in names:
        raise ScenarioError(f"{where}.name", "must be a unique non-empty string")
    _check_tool_name(tool["name"], f"{where}.name")
    names.add(tool["name"])
    with faults.part():
        _check_description(tool, where)
    with faults.part():
        if "parameters" in tool:
            _check_schema(tool["parameters"], f"{where}.parameters")
    with faults.part():
        if "advertises" in tool and (
            not isinstance(tool["advertises"], list) or not all(isinstance(n, str) for n in tool["advertises"])
        ):
            raise ScenarioError(f"{where}.advertises", "must be a list of tool names")
    with faults.part():
        if "concurrency" in tool:
            conc = _obj(tool["concurrency"], f"{where}.concurrency", ("key", "concurrent"), (), faults)
            if not isinstance(conc["key"], str) or not isinstance(conc["concurrent"], bool):
                raise ScenarioError(f"{where}.concurrency", "needs a string key and a boolean concurrent")
    for flag in ("direct_result", "deferred"):
        with faults.part():
            if flag in tool and not isinstance(tool[flag], bool):
                raise ScenarioError(f"{where}.{flag}", "must be a boolean")
    with faults.part():
        _check_result(tool["result"], f"{where}.result", faults)
    return tool


def _check_delegate(
    delegate: Any, where: str, names: set[str], own: Budget, base_dir: Path | None, faults: _Faults
) -> None:
    """One Delegate (``$.delegates[i]``); its scenario is validated (and normalized) in place."""
    delegate = _obj(delegate, where, ("name", "input_schema", "scenario"), ("description", "budget"), faults)
    with faults.part():
        if not isinstance(delegate["name"], str) or not delegate["name"]:
            raise ScenarioError(f"{where}.name", "must be a non-empty string")
        _check_tool_name(delegate["name"], f"{where}.name")
        if delegate["name"] in names:
            raise ScenarioError(f"{where}.name", "collides with a tool or another delegate")
        names.add(delegate["name"])
    with faults.part():
        _check_description(delegate, where)
    with faults.part():
        _check_schema(delegate["input_schema"], f"{where}.input_schema")
        if not isinstance(delegate["input_schema"], dict) or delegate["input_schema"].get("type") != "object":
            raise ScenarioError(f"{where}.input_schema", "must be an object schema")
    granted = Budget()  # a budget at fault: the nested scenario's grants are not judged against it
    with faults.part():
        granted = _grant(own, delegate.get("budget"), f"{where}.budget", "the Delegate")
    delegate["scenario"] = validate_scenario(delegate["scenario"], f"{where}.scenario", base_dir, granted)


def _check_limits(doc: dict[str, Any], path: str, calls_tools: bool, faults: _Faults) -> None:
    limits = _obj(doc.get("limits", {}), f"{path}.limits", (), ("max_model_calls", "max_concurrent_tool_calls"), faults)
    calls = limits.get("max_model_calls")
    with faults.part():
        if "max_model_calls" in limits and (not isinstance(calls, int) or isinstance(calls, bool) or calls < 1):
            raise ScenarioError(f"{path}.limits.max_model_calls", "must be an integer of at least 1 (omit it for unlimited)")
    concurrent = limits.get("max_concurrent_tool_calls")
    if "max_concurrent_tool_calls" in limits and (
        not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 0
    ):
        raise ScenarioError(f"{path}.limits.max_concurrent_tool_calls", "must be a non-negative integer")
    if concurrent and not calls_tools:
        raise ScenarioError(f"{path}.limits.max_concurrent_tool_calls",
                            "bounds the calls of tools and delegates: give it only with tools or delegates")


def _grant(parent: Budget, value: Any, path: str, whom: str) -> Budget:
    """The Budget ``value`` describes, granted to ``whom`` out of ``parent`` (kernel rule
    ``budget.child_allocation``: under a finite parent quota a grant is finite and at most it)."""
    try:
        budget = Budget.from_json(value)
    except InvalidInput as exc:
        raise ScenarioError(path, exc.message) from exc
    refused = child_debit(parent, budget)
    if isinstance(refused, str):
        limits = ", ".join(
            f"{name} <= {quota.maximum}" for name in ("steps", "effects", "signals")
            if (quota := getattr(parent, name)).maximum is not None
        )
        raise ScenarioError(
            path,
            f"{whom} would be refused its budget: {refused} (this scenario runs within the Delegate budget "
            f"{limits}; give {path.rsplit('.', 1)[-1]} a finite maximum of at most that for each of them)",
        )
    return budget


def _check_description(value: dict[str, Any], path: str) -> None:
    if "description" in value and not isinstance(value["description"], str):
        raise ScenarioError(f"{path}.description", "must be a string")


def _check_tool_name(name: str, path: str) -> None:
    """A tool's or a Delegate's name as the Interaction's toolset takes it, refused here with its path."""
    try:
        check_name(name, "a")
    except InvalidInput as exc:
        raise ScenarioError(path, f"{name[:80]!r} must be 1-128 characters of [A-Za-z0-9_.-]") from exc


def _side_effect_log(value: Any, path: str, base_dir: Path | None) -> str:
    """The absolute path of a side-effect log, refused now if no tool could ever append to it
    (each tool call would fail inside the tool and become unknown).

    In a process confined to a side-effect folder (``serve``, :func:`side_effect_confinement`)
    a relative path resolves against that folder, and the path is checked to be inside it
    as given, before anything on disk is looked at: a refusal never shows where a path
    outside the folder leads (``/proc/self/cwd/...``) or whether a folder there exists.
    """
    if not isinstance(value, str) or not value:
        raise ScenarioError(path, "must be a file path")
    if "\0" in value:
        raise ScenarioError(path, "must not contain a NUL character")
    folder: Path | None = None
    if _CONFINEMENT.active:
        folder = _CONFINEMENT.folder
        if folder is None:
            raise ScenarioError(path, _NO_LOGS)
        base_dir = folder
        if _lexically_inside(value, folder) is None:
            normal = Path(os.path.normpath(value if os.path.isabs(value) else os.path.join(folder, value)))
            if normal in (folder, _CONFINEMENT.given):
                raise ScenarioError(path, f"{value!r} is this server's --side-effect-dir itself: give the path of a "
                                    "file inside it to append to")
            raise ScenarioError(path, f"{value!r} is outside this server's --side-effect-dir {str(folder)!r}")
    log = Path(value)
    if not log.is_absolute():
        log = (base_dir or Path.cwd()) / log
    try:
        log = log.resolve()
        if folder is not None and not log.is_relative_to(folder):
            # A symbolic link inside the folder leads out of it: where to is not told.
            raise ScenarioError(path, f"{value!r} leads outside this server's --side-effect-dir {str(folder)!r} "
                                "through a symbolic link")
        if log.is_dir():
            raise ScenarioError(path, f"{str(log)!r} is a directory; give the path of a file to append to")
        if not log.parent.is_dir():
            raise ScenarioError(path, f"the folder {str(log.parent)!r} does not exist; create it first")
    except (OSError, RuntimeError) as exc:  # e.g. a symlink loop, a name too long
        if folder is not None:  # the message could name what lies outside the folder
            raise ScenarioError(path, f"{value!r} is not a usable file path inside this server's "
                                "--side-effect-dir") from exc
        raise ScenarioError(path, f"is not a usable file path: {exc}") from exc
    return str(log)


_NO_LOGS = "this server writes no side-effect logs (it was started without --side-effect-dir): drop side_effect_log"


class _Confinement:
    """Where this process may append side-effect logs: anywhere (``active`` False: a CLI
    command appends where its scenario says), or only inside ``folder`` (resolved; None:
    nowhere), as ``agentfold serve`` with or without ``--side-effect-dir``."""

    active = False
    folder: Path | None = None
    given: Path | None = None  # the folder as the operator wrote it (absolute, not resolved)


_CONFINEMENT = _Confinement()


@contextlib.contextmanager
def side_effect_confinement(folder: Path | None) -> Iterator[None]:
    """Confine every side-effect log this process validates or appends to to ``folder``
    (None: refuse them all) until the block ends: what ``serve`` does for all the runs it
    drives, whoever started them (over HTTP, a CLI command, an import)."""
    previous = (_CONFINEMENT.active, _CONFINEMENT.folder, _CONFINEMENT.given)
    _CONFINEMENT.folder = folder.resolve() if folder is not None else None
    _CONFINEMENT.given = Path(os.path.abspath(folder)) if folder is not None else None
    _CONFINEMENT.active = True
    try:
        yield
    finally:
        _CONFINEMENT.active, _CONFINEMENT.folder, _CONFINEMENT.given = previous


def _lexically_inside(log: str, folder: Path) -> tuple[str, ...] | None:
    """The names leading from ``folder`` to ``log`` as written (relative: against ``folder``),
    with ``.`` and ``..`` folded without looking at the disk; None when that leaves the
    folder or names the folder itself. ``folder`` is the resolved ``--side-effect-dir``; the
    folder as the operator wrote it (which may be a link to it) is accepted as well."""
    given = log if os.path.isabs(log) else os.path.join(folder, log)
    normal = Path(os.path.normpath(given))
    for start in dict.fromkeys((folder, _CONFINEMENT.given or folder)):
        if normal.is_relative_to(start) and normal != start:
            return normal.relative_to(start).parts
    return None


def _is_link(name: str, folder_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=folder_fd).st_mode)
    except OSError:
        return False


class SideEffectLogRefused(Exception):
    """A confined process refused to append to a side-effect log (nothing was written)."""


def open_side_effect_log(path: str, *, readable: bool = False) -> int:
    """A descriptor to append to the side-effect log ``path`` (created 0644 if missing).

    Unconfined (a CLI command): the path as it is. Confined (:func:`side_effect_confinement`):
    checked at every open, since the file system may have changed since the run was
    validated, or the run was never validated by this process (imported, started by a CLI
    command and adopted): ``path`` must be inside the folder as written, and it is opened
    from the folder one name at a time without following a symbolic link (``O_NOFOLLOW``),
    so no link swapped in at any step leads out; the file must be a regular file with a
    single link (a hard link could be another name of a file outside) or a FIFO. Otherwise
    :class:`SideEffectLogRefused`, with nothing written. ``readable``: open it for reading
    too (the kernel demo reads its log before it sends a receipt); confined, only a regular
    file then (a FIFO would hold the reader).
    """
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    if not _CONFINEMENT.active:
        return os.open(path, flags, 0o644)
    folder = _CONFINEMENT.folder
    if folder is None:
        raise SideEffectLogRefused(_NO_LOGS)
    names = _lexically_inside(path, folder)
    if names is None:
        raise SideEffectLogRefused(f"{path!r} is outside this server's --side-effect-dir")
    here = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(names):
            last = i == len(names) - 1
            try:
                if last:
                    fd = os.open(name, flags | os.O_NOFOLLOW, 0o644, dir_fd=here)
                else:
                    below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            except OSError as exc:
                # O_NOFOLLOW refuses a link: ELOOP for a file, ENOTDIR for a folder (Linux).
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, here):
                    raise SideEffectLogRefused(
                        f"{path!r} is, or lies under, a symbolic link (this server's --side-effect-dir follows none)"
                    ) from exc
                raise
            if not last:
                os.close(here)
                here = below
    finally:
        os.close(here)
    status = os.fstat(fd)
    if stat.S_ISFIFO(status.st_mode) and not readable:
        return fd  # a pipe inside the folder: a reader there takes the lines (as before)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(fd)
        raise SideEffectLogRefused(f"{path!r} is not a regular file with a single link (nor a FIFO)")
    return fd


def side_effect_logs(doc: dict[str, Any], path: str = "$") -> list[tuple[str, str]]:
    """Every ``side_effect_log`` of a validated scenario and of its Delegates' scenarios, with
    where each is (``$.delegates[0].scenario.side_effect_log``)."""
    found = [(f"{path}.side_effect_log", str(doc["side_effect_log"]))] if doc.get("side_effect_log") else []
    for i, delegate in enumerate(doc.get("delegates", [])):
        found += side_effect_logs(delegate["scenario"], f"{path}.delegates[{i}].scenario")
    return found


def confine_side_effect_logs(doc: dict[str, Any], folder: Path | None) -> None:
    """Refuse a validated scenario that names a side-effect log outside ``folder`` (any log
    when ``folder`` is None): what a server lets a client's scenario append to."""
    for where, log in side_effect_logs(doc):
        problem = side_effect_log_refusal(log, folder)
        if problem is not None:
            raise ScenarioError(where, problem)


def side_effect_log_refusal(log: str, folder: Path | None) -> str | None:
    """Why a server refuses the (absolute) side-effect log ``log``, or None when it is inside ``folder``."""
    if folder is None:
        return _NO_LOGS
    if not Path(log).is_relative_to(folder.resolve()):
        return f"{log!r} is outside this server's --side-effect-dir {str(folder.resolve())!r}"
    return None


def confined_input_log(value: Any, where: str, folder: Path | None) -> str:
    """A Program input's ``side_effect_log`` (the kernel demo's), resolved against ``folder`` and
    refused outside it, as a scenario's is (``engine.start.input_invalid``)."""
    try:
        log = _side_effect_log(value, where, folder)
    except ScenarioError as exc:
        raise InvalidInput("engine.start.input_invalid", exc.message) from exc
    problem = side_effect_log_refusal(log, folder)
    if problem is not None:
        raise InvalidInput("engine.start.input_invalid", f"{where}: {problem}")
    return log


def load_scenario_file(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise InvalidInput("scenario.unreadable", f"cannot read scenario {path}: {exc.strerror}") from exc
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ScenarioError("$", f"not valid JSON: {exc}") from exc
    duplicate = duplicate_key(text)
    if duplicate is None:
        return validate_scenario(doc, "$", file.parent.resolve())
    # The fault, and what the document holds besides (read with the last of the two values).
    faults = _Faults()
    faults.add(duplicate[0], f"has the key {duplicate[1]!r} twice (JSON parsers keep only the last one, silently)")
    with faults.part():
        validate_scenario(doc, "$", file.parent.resolve())
    error = faults.error()
    assert error is not None  # the duplicate is one
    raise error


# ---------------------------------------------------------------------------
# Scenario tools


class SideEffectLog:
    """Every real tool execution appends one JSON line ``{"tool", "call_id", "arguments",
    "effect_id", "resumed"}``: the Effect it runs under (the same again only on a replay of
    that Effect) and whether it resumes after a human answer (an approval tool's ask and its
    resume are two executions of one call, under two Effects)."""

    # Writers of one path in this process take turns; striped by path, not one lock per path
    # kept for good (a server kept one per side-effect log any scenario ever named).
    _locks: tuple[threading.Lock, ...] = tuple(threading.Lock() for _ in range(64))

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = SideEffectLog._locks[hash(path) % len(SideEffectLog._locks)]

    def record(self, tool: str, call_id: str, arguments: str, effect_id: str, resumed: bool) -> None:
        entry = {"tool": tool, "call_id": call_id, "arguments": arguments, "effect_id": effect_id, "resumed": resumed}
        line = json.dumps(entry, sort_keys=True) + "\n"
        with self._lock:
            fd = open_side_effect_log(self.path)
            try:
                os.write(fd, line.encode())
                try:
                    os.fsync(fd)
                except OSError as exc:
                    # A pipe, FIFO or terminal holds nothing to sync (EINVAL): the line is written.
                    if exc.errno != errno.EINVAL:
                        raise
            finally:
                os.close(fd)


def _subset(when: dict[str, Any], arguments: Any) -> bool:
    return isinstance(arguments, dict) and all(k in arguments and arguments[k] == v for k, v in when.items())


def _output(value: JSON) -> ToolOutput:
    if isinstance(value, str):
        return ToolOutput.text(value)
    return ToolOutput((), value)


class ScenarioTool:
    """A tool whose behaviour the scenario scripts."""

    def __init__(self, spec: dict[str, Any], log: SideEffectLog | None) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.description: str = spec.get("description", "")
        self.parameters: JSON = spec.get("parameters", {"type": "object"})
        self.direct_result = bool(spec.get("direct_result", False))
        self.log = log
        conc = spec.get("concurrency")
        if conc is not None:
            key, concurrent = str(conc["key"]), bool(conc["concurrent"])

            def classify(call: Any, arguments: JSON) -> tuple[str, bool]:
                return key, concurrent

            self.concurrency = classify
        advertised = list(spec.get("advertises", ()))
        if advertised:

            def advertise(invocation: ToolInvocation, output: ToolOutput) -> list[str]:
                return advertised

            self.advertise = advertise

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        if self.log is not None:
            try:
                self.log.record(
                    self.name, invocation.call.id, invocation.call.arguments, str(invocation.effect_id),
                    invocation.continuation is not None,
                )
            except SideEffectLogRefused as exc:
                # Definite: nothing was written and the scripted result was not produced. The
                # run sees a rejected tool result, as for any call a tool refuses.
                raise ToolFailure(
                    "rejected", f"error: refused: this server does not append to the side-effect log: {exc}"
                ) from exc
        return self._run(self.spec["result"], invocation, arguments)

    def _run(self, result: dict[str, Any], invocation: ToolInvocation, arguments: JSON, stage: int = 0) -> ToolOutput:
        """The scripted result. ``stage``: how many ``input`` forms the walk passed so far.
        The walk is the same for every attempt of a call (cases match its arguments only), so
        the input a resumed call was answered for is the one at the stage its request named
        (``{"stage": n}``; ``{}`` is the first, as releases that asked one question stored it):
        the earlier ones are passed, a later one is asked in turn (another input wait)."""
        if "output" in result:
            return _output(result["output"])
        if "echo" in result:
            return ToolOutput((json.dumps(arguments, sort_keys=True),), arguments)
        if "failure" in result:
            raise ToolFailure(result["failure"]["kind"], result["failure"]["output"])
        if "error" in result:
            raise RuntimeError(result["error"])
        if "input" in result:
            if stage > _answered_stage(invocation):
                raise ToolInputRequired(result["input"]["prompt"], result["input"]["response_schema"],
                                        {"stage": stage} if stage else {})
            return self._run(result["then"], invocation, arguments, stage + 1)
        if "answer" in result:  # only below an input's then (validated): the latest answer
            if invocation.continuation is None:  # pragma: no cover - validated
                raise RuntimeError(f"tool {self.name} returns an answer it was never given")
            return _output(invocation.continuation.response)
        for case in result.get("cases", []):
            if _subset(case["when"], arguments):
                return self._run(case["result"], invocation, arguments, stage)
        if "otherwise" in result:
            return self._run(result["otherwise"], invocation, arguments, stage)
        raise RuntimeError(f"no case of tool {self.name} matches its arguments")


def _answered_stage(invocation: ToolInvocation) -> int:
    """The stage of the input a resumed call was answered for (-1: not resumed)."""
    if invocation.continuation is None:
        return -1
    state = invocation.continuation.state
    stage = state.get("stage", 0) if isinstance(state, dict) else 0
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0


def scenario_program(doc: dict[str, Any], *, legacy: bool = False, delegate_budgets: bool = True) -> Program:
    """Build the exact Program of a validated scenario (deterministic: same doc, same ProgramRef).

    The Tool child Program's identity includes the whole document: its tools behave as the
    document scripts them (results, side-effect log), so two documents with the same tool
    definitions are two different Tool programs. ``legacy`` builds the identity releases
    before 2026-11-30 gave it (the definitions only), so trees they stored still load.
    ``delegate_budgets=False`` builds what releases before 2026-12-01 built: they accepted
    a Delegate's ``budget`` but granted its child an unlimited one.
    """
    log = SideEffectLog(doc["side_effect_log"]) if doc.get("side_effect_log") else None
    tools = [ScenarioTool(t, log) for t in doc.get("tools", []) if not t.get("deferred")]
    deferred = [ScenarioTool(t, log) for t in doc.get("tools", []) if t.get("deferred")]
    delegates = []
    for spec in doc.get("delegates", []):
        nested = spec["scenario"]
        fixed_input = nested.get("input")

        def build_input(arguments: JSON, fixed: Any = fixed_input) -> JSON:
            if fixed is not None:
                return fixed
            return {"messages": [{"role": "user", "content": json.dumps(arguments, sort_keys=True)}]}

        delegates.append(
            Delegate(
                name=spec["name"],
                description=spec.get("description", ""),
                program=scenario_program(nested, legacy=legacy, delegate_budgets=delegate_budgets),
                input_schema=spec["input_schema"],
                budget=Budget.from_json(spec.get("budget")) if delegate_budgets else Budget(),
                build_input=build_input,
            )
        )
    limits = doc.get("limits", {})
    responses = [
        r if "error" in r else {**r, "message": {"role": "assistant", **r["message"]}}
        for r in doc["model"]["responses"]
    ]
    return compile_interaction(
        InteractionConfig(
            name=PROGRAM_NAME,
            description=doc.get("description", ""),
            model=ScriptedModel(responses),
            tools=tools,
            deferred_tools=deferred,
            delegates=delegates,
            max_model_calls=limits.get("max_model_calls"),
            max_concurrent_tool_calls=limits.get("max_concurrent_tool_calls", 0),
            tool_budget=Budget.from_json(doc.get("tool_budget")),
            model_identity="scripted",  # type: ignore[arg-type]
            tool_identity="scenario" if legacy else "scenario:" + digest_of(doc),  # type: ignore[arg-type]
            callback_identity="none",  # type: ignore[arg-type]
            configuration=doc,
        )
    )


def scenario_input(doc: dict[str, Any]) -> JSON:
    return doc.get("input") or {"messages": [{"role": "user", "content": doc["name"]}]}


def unbudgeted_scenario_program(doc: dict[str, Any]) -> Program:
    """A scenario Program as releases before 2026-12-01 built it: Delegate budgets ignored."""
    return scenario_program(doc, delegate_budgets=False)


def legacy_scenario_program(doc: dict[str, Any]) -> Program:
    """A scenario Program with the Tool identity of trees stored before 2026-11-30."""
    return scenario_program(doc, legacy=True, delegate_budgets=False)


#: How a stored scenario tree's Program is rebuilt: the current identity, then the earlier ones.
SCENARIO_LOADERS = (scenario_program, unbudgeted_scenario_program, legacy_scenario_program)


def scenario_catalog(*programs: Program) -> Catalog:
    """A Catalog that rebuilds scenario Programs from the document stored with each tree."""
    return Catalog(programs, loaders={PROGRAM_NAME: SCENARIO_LOADERS})
