"""docs/errors.md lists every error code agentfold raises or records, with the right statuses.

The codes are found in the source, not in a hand-kept list: an ``ast`` scan of ``agentfold/``
follows every call that makes a code —

* a class derived from ``AgentfoldError`` (its first argument, or the code its own
  ``__init__`` passes to ``super().__init__``, e.g. ``ScenarioError``, ``CorruptStream``),
  with the CLI exit status and HTTP status of that class;
* ``Failure`` (and ``ClassifiedError``, whose constructor builds one): a persisted code;
* any helper function or constructor that passes one of its parameters on as such a code
  (``_failure``, ``refuse``, ``seconds_setting(code=...)``, ``_unknown``), to a fixed point,
  with the code given by keyword or by position, or left to the parameter's default;
* a function taking an HTTP ``status`` and a ``code`` (``problem_response``): an answer of
  the HTTP server only;

where the code is a string literal, an ``EngineCode.X`` (or any class or module constant),
or a name the function assigns from such values. A code that comes from another error
(``exc.code``: a re-raise) is the only thing the scan may not follow.

Then: (a) every raised and every recorded code is in docs/errors.md, (b) every code the page
lists is raised or recorded somewhere (the "Reserved codes" section excepted: there every
code must be defined and never used), (c) the exit and HTTP statuses the page gives are
those of the code's class. The last tests prove that the check fails when a code is added
without documenting it (a fake module added to the scanned sources, not to agentfold/).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agentfold"
DOCS = ROOT / "docs"
PAGE = DOCS / "errors.md"

# ---------------------------------------------------------------------------
# The scan of agentfold/: which codes are raised, by which class, and which are persisted

CODE = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+")
ROOT_CLASS = ("agentfold.domain.errors", "AgentfoldError")
FAILURE_CLASS = ("agentfold.domain.errors", "Failure")

Key = tuple[str, str]  # (module, name) of a class or function definition


@dataclass(frozen=True)
class Site:
    code: str
    kind: str  # "error": an AgentfoldError raised; "failure": a persisted Failure; "problem": an HTTP answer
    where: str
    exit_status: int | None = None
    http_status: int | None = None


@dataclass
class Sink:
    """A callable that makes one of its arguments a code: an error class, Failure, or a helper."""

    kind: str
    index: int  # position of the code among the call's arguments
    param: str  # its keyword name
    exit_status: int | None = None
    http_status: int | None = None
    status_index: int | None = None  # position of an HTTP status argument (problem_response)
    fixed: str | None = None  # a class that always carries this code
    default: str | None = None  # the code when a call leaves it out


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return names + [a.arg for a in fn.args.kwonlyargs]


def _default(fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> str | None:
    positional = fn.args.posonlyargs + fn.args.args
    pairs = list(zip(positional[len(positional) - len(fn.args.defaults):], fn.args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d is not None]
    for arg, value in pairs:
        if arg.arg == param and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


class Scan:
    """Every call that makes a code, found in the sources given (module path -> text)."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.trees = {self._dotted(path): (path, ast.parse(text)) for path, text in sources.items()}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.classes: dict[Key, ast.ClassDef] = {}
        self.functions: dict[Key, list[ast.FunctionDef | ast.AsyncFunctionDef]] = defaultdict(list)
        self.imports: dict[str, dict[str, Key]] = defaultdict(dict)
        self.constants: dict[str, dict[str, str]] = defaultdict(dict)  # module -> NAME / Class.NAME -> code
        self._by_name: dict[str, list[Key]] | None = None  # every definition by its name (built once indexed)
        self._calls: dict[int, list[ast.Call]] = {}  # the calls inside each function, by id(function)
        self.module_calls: dict[str, list[ast.Call]] = {}  # every call of each module, in ast.walk order
        for module, (_path, tree) in self.trees.items():
            self._index(module, tree)
        self.sinks: dict[Key, list[Sink]] = defaultdict(list)
        self.unfollowed_classes: list[str] = []
        self._class_sinks()
        self._helper_sinks()
        self.unfollowed: list[str] = []
        self.sites = self._sites()

    @staticmethod
    def _dotted(path: str) -> str:
        parts = path.removesuffix(".py").split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _index(self, module: str, tree: ast.Module) -> None:
        calls = self.module_calls[module] = []
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Call):
                calls.append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes[(module, node.name)] = node
                for item in node.body:
                    if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant):
                        for target in item.targets:
                            if isinstance(target, ast.Name) and isinstance(item.value.value, str):
                                self.constants[module][f"{node.name}.{target.id}"] = item.value.value
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[(module, node.name)].append(node)
            elif isinstance(node, ast.ImportFrom) and node.module:
                source = node.module
                if node.level:
                    source = ".".join([*module.split(".")[: -node.level], node.module])
                for alias in node.names:
                    self.imports[module][alias.asname or alias.name] = (source, alias.name)
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.constants[module][target.id] = node.value.value

    def resolve(self, module: str, name: str, depth: int = 0) -> list[Key]:
        """The definitions ``name`` means in ``module``; every one of that name when it is not known there."""
        key = (module, name)
        if key in self.classes or key in self.functions:
            return [key]
        if name in self.imports.get(module, {}) and depth < 10:
            source, original = self.imports[module][name]
            return self.resolve(source, original, depth + 1) if source in self.trees else []
        if depth:
            return []
        if self._by_name is None:
            self._by_name = defaultdict(list)
            for k in (*self.classes, *self.functions):
                self._by_name[k[1]].append(k)
        return list(self._by_name.get(name, ()))

    def _constant(self, module: str, name: str) -> str | None:
        """A string constant ``NAME`` or ``Class.NAME`` as seen from ``module`` (own or imported)."""
        head, _, rest = name.partition(".")
        if name in self.constants.get(module, {}):
            return self.constants[module][name]
        if head in self.imports.get(module, {}):
            source, original = self.imports[module][head]
            return self.constants.get(source, {}).get(".".join(filter(None, (original, rest))))
        return None

    # -- classes ----------------------------------------------------------------
    def lineage(self, key: Key) -> list[Key]:
        out: list[Key] = []
        while key in self.classes and key not in out:
            out.append(key)
            bases = [k for base in self.classes[key].bases if (n := _name(base))
                     for k in self.resolve(key[0], n) if k in self.classes]
            if not bases:
                break
            key = bases[0]
        return out

    def _class_value(self, key: Key, attribute: str) -> Any:
        for item in self.classes[key].body:
            targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
            value = getattr(item, "value", None)
            if isinstance(value, ast.Constant) and any(isinstance(t, ast.Name) and t.id == attribute for t in targets):
                return value.value
        return None

    def status(self, key: Key) -> tuple[int, int] | None:
        """(CLI exit status, HTTP status) of an AgentfoldError class; None for any other class."""
        lineage = self.lineage(key)
        if ROOT_CLASS not in lineage:
            return None
        exit_status = next(v for k in lineage if (v := self._class_value(k, "exit_status")) is not None)
        http_status = next(v for k in lineage if (v := self._class_value(k, "http_status")) is not None)
        return exit_status, http_status

    def _init(self, key: Key) -> tuple[Key, ast.FunctionDef] | None:
        for owner in self.lineage(key):
            for item in self.classes[owner].body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return owner, item
        return None

    def _class_sinks(self) -> None:
        failure = self.classes.get(FAILURE_CLASS)
        fields = [i.target.id for i in (failure.body if failure else [])
                  if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)]
        if "code" in fields:
            self.sinks[FAILURE_CLASS].append(Sink("failure", fields.index("code"), "code"))
        for key in self.classes:
            status = self.status(key)
            if status is None:
                continue
            sink = Sink("error", 0, "code", *status)
            init = self._init(key)
            if init is not None and init[0] != ROOT_CLASS:
                # a subclass with its own constructor: super().__init__("code", ...) or (param, ...)
                params = _params(init[1], method=True)
                sink.index, sink.param = -1, ""
                for call in ast.walk(init[1]):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "__init__" and isinstance(call.func.value, ast.Call) and call.args):
                        first = call.args[0]
                        if isinstance(first, ast.Constant) and isinstance(first.value, str):
                            sink.fixed = first.value
                        elif isinstance(first, ast.Name) and first.id in params:
                            sink.index, sink.param = params.index(first.id), first.id
                if sink.fixed is None and sink.index < 0:
                    self.unfollowed_classes.append(f"{key[0]}.{key[1]}")
                    continue
            self.sinks[key].append(sink)

    # -- helpers ----------------------------------------------------------------
    def _callee_sinks(self, module: str, call: ast.Call) -> list[Sink]:
        name = _name(call.func)
        if name is None:
            return []
        return [s for key in self.resolve(module, name) for s in self.sinks.get(key, [])]

    @staticmethod
    def _argument(call: ast.Call, sink: Sink) -> ast.expr | None:
        for kw in call.keywords:
            if kw.arg == sink.param:
                return kw.value
        if 0 <= sink.index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: sink.index + 1]):
            return call.args[sink.index]
        return None

    def _helper_sinks(self) -> None:
        """A function (or a class's constructor) that passes a parameter on as a code is a sink too."""
        done: set[int] = set()
        changed = True
        while changed:
            changed = False
            for (module, name), fns in list(self.functions.items()):
                for fn in fns:
                    if id(fn) in done:
                        continue
                    owner = self.parents.get(fn)
                    method = isinstance(owner, ast.ClassDef)
                    key = (module, name)
                    if name == "__init__":
                        if not isinstance(owner, ast.ClassDef) or self.status((module, owner.name)) is not None:
                            continue
                        key = (module, owner.name)
                    params = _params(fn, method)
                    calls = self._calls.get(id(fn))
                    if calls is None:
                        calls = self._calls[id(fn)] = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
                    for call in calls:
                        for sink in self._callee_sinks(module, call):
                            arg = self._argument(call, sink) if sink.fixed is None else None
                            if isinstance(arg, ast.Name) and arg.id in params:
                                helper = Sink(sink.kind, params.index(arg.id), arg.id, sink.exit_status,
                                              sink.http_status, default=_default(fn, arg.id))
                                status = (call.args[sink.status_index] if sink.status_index is not None
                                          and sink.status_index < len(call.args) else None)
                                if isinstance(status, ast.Name) and status.id in params:
                                    helper.status_index = params.index(status.id)
                                self.sinks[key].append(helper)
                                done.add(id(fn))
                                changed = True
                                break
                        if id(fn) in done:
                            break
                    if id(fn) not in done and "code" in params and "status" in params:
                        # builds an answer from an HTTP status and a code (problem_response)
                        self.sinks[key].append(Sink("problem", params.index("code"), "code",
                                                    status_index=params.index("status")))
                        done.add(id(fn))
                        changed = True

    # -- sites ------------------------------------------------------------------
    def _enclosing(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return None

    def _codes(self, module: str, node: ast.expr) -> set[str]:
        """The codes an expression can hold: literals, constants, what the function assigns to a name."""
        found: set[str] = set()
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                found.add(node.value)
        elif isinstance(node, ast.Attribute | ast.Name):
            constant = self._constant(module, ast.unparse(node))
            if constant is not None:
                found.add(constant)
            elif isinstance(node, ast.Name) and (fn := self._enclosing(node)) is not None:
                for sub in ast.walk(fn):
                    if isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in sub.targets):
                        for part in ast.walk(sub.value):
                            if isinstance(part, ast.Constant | ast.Attribute) and isinstance(part, ast.expr):
                                found |= {c for c in self._codes(module, part) if CODE.fullmatch(c)}
        elif isinstance(node, ast.IfExp):
            found = self._codes(module, node.body) | self._codes(module, node.orelse)
        return found

    def _sites(self) -> list[Site]:
        sites: list[Site] = []
        for module, (path, _tree) in self.trees.items():
            for call in self.module_calls[module]:
                for sink in self._callee_sinks(module, call):
                    where = f"{path}:{call.lineno}"
                    http = sink.http_status
                    if sink.status_index is not None:
                        status = call.args[sink.status_index] if sink.status_index < len(call.args) else None
                        http = status.value if isinstance(status, ast.Constant) and isinstance(status.value, int) else None
                    if sink.fixed is not None:
                        sites.append(Site(sink.fixed, sink.kind, where, sink.exit_status, http))
                        continue
                    arg = self._argument(call, sink)
                    codes = self._codes(module, arg) if arg is not None else {sink.default} if sink.default else set()
                    if not codes and arg is not None:
                        fn = self._enclosing(call)
                        params = _params(fn, isinstance(self.parents.get(fn), ast.ClassDef)) if fn else []
                        if not (isinstance(arg, ast.Name) and arg.id in params):  # a helper's own parameter
                            self.unfollowed.append(f"{where}: {ast.unparse(arg)}")
                    sites.extend(Site(code, sink.kind, where, sink.exit_status, http) for code in sorted(codes))
        return sites




def sources(extra: dict[str, str] | None = None) -> dict[str, str]:
    found = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}
    return {**found, **(extra or {})}


@functools.cache
def scanned() -> Scan:
    return Scan(sources())


# ---------------------------------------------------------------------------
# The page: one table row per code, in a section that says what kind of code it is

RAISED, FAILURE, RESERVED = "raised", "failure", "reserved"
DASH = "\u2013"  # the exit column of a code only the HTTP server answers
ROW = re.compile(r"^\| `([a-z][a-z0-9_.-]*)` \|(.*)\|\s*$")


@dataclass(frozen=True)
class Row:
    code: str
    section: str
    cells: tuple[str, ...]  # after the code
    line: int


def page_rows(text: str) -> list[Row]:
    rows: list[Row] = []
    section = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            title = line[3:].lower()
            section = FAILURE if "failure codes" in title else RESERVED if "reserved" in title else RAISED
        match = ROW.match(line)
        if match and section:
            rows.append(Row(match[1], section, tuple(c.strip() for c in match[2].split(" | ")), number))
    return rows


@functools.cache
def page() -> list[Row]:
    return page_rows(PAGE.read_text(encoding="utf-8"))


def codes_of(scan: Scan) -> dict[str, set[str]]:
    """kind -> codes: "raised" (an error or an HTTP answer) and "failure" (recorded in a run)."""
    out: dict[str, set[str]] = {RAISED: set(), FAILURE: set()}
    for site in scan.sites:
        out[FAILURE if site.kind == "failure" else RAISED].add(site.code)
    return out


def undocumented(scan: Scan, rows: list[Row]) -> dict[str, list[str]]:
    """What the scan finds that the page does not list in the right section, with one site each."""
    listed = {section: {r.code for r in rows if r.section == section} for section in (RAISED, FAILURE)}
    missing: dict[str, list[str]] = defaultdict(list)
    for site in scan.sites:
        section = FAILURE if site.kind == "failure" else RAISED
        if site.code not in listed[section]:
            missing[site.code].append(f"{section} at {site.where}")
    return dict(missing)


def first_number(cell: str) -> int | None:
    found = re.search(r"\d+", cell)
    return int(found[0]) if found else None


#: Codes raised with more than one class. The page gives the status a user meets; it must be
#: one of the scanned ones. Keep this short: one code, one class is the rule.
SEVERAL_CLASSES = {
    # catalog/host/audit: NotFound; runtime.py's adoption check: a plain AgentfoldError that
    # only ever reaches `recover`'s per-tree entry.
    "engine.program.unavailable",
    # eventstore: StoreFailure; cli.py's last resort for an unclassified store exception: a
    # plain AgentfoldError (exit 1 either way; the HTTP server answers such an exception 503).
    "store.unavailable",
    # NotFound at most sites; the lead is making it NotFound everywhere (then drop it here).
    "engine.effect.not_pending",
}


def status_mismatches(scan: Scan, rows: list[Row]) -> list[str]:
    statuses: dict[str, set[tuple[int | None, int | None]]] = defaultdict(set)
    answers: dict[str, set[int | None]] = defaultdict(set)
    for site in scan.sites:
        if site.kind == "error":
            statuses[site.code].add((site.exit_status, site.http_status))
        elif site.kind == "problem":
            answers[site.code].add(site.http_status)
    wrong: list[str] = []
    for row in rows:
        if row.section != RAISED:
            continue
        exit_cell, http_cell = row.cells[0], row.cells[1]
        found = statuses.get(row.code, set())
        documented = (first_number(exit_cell), first_number(http_cell))
        if found:
            if len(found) > 1 and row.code not in SEVERAL_CLASSES:
                wrong.append(f"{row.code}: raised with several classes {sorted(found)}; one code, one class")
            elif documented not in found:
                wrong.append(f"docs/errors.md:{row.line}: {row.code} documented exit {documented[0]} / HTTP "
                             f"{documented[1]}, its class gives {sorted(found)}")
        elif answers.get(row.code):
            literal = answers[row.code] - {None}
            if exit_cell != DASH:
                wrong.append(f"docs/errors.md:{row.line}: {row.code} is an HTTP answer only: its exit column is {DASH}")
            if len(literal) == 1 and documented[1] not in literal:
                wrong.append(f"docs/errors.md:{row.line}: {row.code} documented HTTP {documented[1]}, "
                             f"the server answers {sorted(literal, key=str)}")
    return wrong


# ---------------------------------------------------------------------------
# The checks


def test_the_scan_finds_the_codes_of_every_kind_of_call() -> None:
    """A sanity floor: if the scan broke, (a) would pass vacuously."""
    found = codes_of(scanned())
    for code in ("scenario.invalid",  # ScenarioError's own __init__
                 "store.corrupt",  # CorruptStream
                 "engine.tree.version_conflict",  # VersionConflict
                 "http.request_invalid",  # RequestInvalid
                 "http.setting_invalid",  # seconds_setting(code=...)
                 "store.setting_invalid",  # seconds_setting's default
                 "engine.process.start.failed",  # InvalidInput(EngineCode.PROCESS_START_FAILED, ...)
                 "http.timeout", "http.not_found"):  # problem_response, also through a dict of codes
        assert code in found[RAISED], code
    for code in ("execution.transition.invalid",  # refuse(EngineCode.X) -> _failure -> Failure
                 "engine.dispatch.failed",  # _unknown(dispatch, EngineCode.X)
                 "interaction.state.invalid",  # ClassifiedError
                 "demo.payment.charge_failed"):  # a module constant
        assert code in found[FAILURE], code
    assert len(found[RAISED]) > 100 and len(found[FAILURE]) > 30


def test_the_scan_follows_every_code() -> None:
    """A code the scan cannot read is a code the page may miss: only re-raises are allowed."""
    scan = scanned()
    assert scan.unfollowed_classes == []
    passthrough = re.compile(r"(str\()?[a-z_.]+(\.code|\['code'\])\)?")
    assert [u for u in scan.unfollowed if not passthrough.fullmatch(u.split(": ", 1)[1])] == []


def test_every_code_agentfold_raises_or_records_is_on_the_page() -> None:
    assert undocumented(scanned(), page()) == {}


def test_every_code_on_the_page_is_raised_or_recorded() -> None:
    found = codes_of(scanned())
    dead = [f"docs/errors.md:{r.line}: {r.code} ({r.section})" for r in page()
            if r.section in (RAISED, FAILURE) and r.code not in found[r.section]]
    assert dead == []


def test_reserved_codes_are_defined_and_never_used() -> None:
    scan = scanned()
    defined = set(scan.constants["agentfold.domain.errors"].values())
    used = codes_of(scan)[RAISED] | codes_of(scan)[FAILURE]
    for row in page():
        if row.section == RESERVED:
            assert row.code in defined, f"{row.code} is not an EngineCode"
            assert row.code not in used, f"{row.code} is used: document it with its family"
    # and every EngineCode is either used or reserved
    engine = {v for k, v in scan.constants["agentfold.domain.errors"].items() if k.startswith("EngineCode.")}
    reserved = {r.code for r in page() if r.section == RESERVED}
    assert engine - used - reserved == set()


def test_each_code_has_one_row_per_section() -> None:
    seen: dict[tuple[str, str], int] = {}
    for row in page():
        assert (row.code, row.section) not in seen, f"{row.code} twice (lines {seen[(row.code, row.section)]}, {row.line})"
        seen[(row.code, row.section)] = row.line


def test_documented_statuses_are_those_of_the_class() -> None:
    assert status_mismatches(scanned(), page()) == []


def _slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_the_links_of_the_page_lead_somewhere() -> None:
    text = PAGE.read_text(encoding="utf-8")
    broken = []
    for target, anchor in re.findall(r"\]\(([a-z0-9_-]*\.md)?(?:#([a-z0-9_-]+))?\)", text):
        doc = DOCS / target if target else PAGE
        if not doc.exists():
            broken.append(target)
            continue
        if anchor:
            heads = {_slug(line.lstrip("#")) for line in doc.read_text(encoding="utf-8").splitlines()
                     if line.startswith("#") and not line.startswith("#!")}
            if anchor not in heads:
                broken.append(f"{target}#{anchor}")
    assert broken == []


# ---------------------------------------------------------------------------
# The check fails when a code is added without documenting it (a fake module in the scanned
# sources: agentfold/ itself is not touched)

FAKE = '''
from agentfold.domain.errors import EngineCode, Failure, FailureKind, InvalidInput, NotFound, StoreFailure
from agentfold.adapters.eventstore import seconds_setting

FAKE_CODE = "fake.constant"


def _refuse(code: str, message: str) -> InvalidInput:
    return InvalidInput(code, message)


def raise_them(flag: bool) -> None:
    if flag:
        raise StoreFailure("fake.literal", "a new code")
    if not flag:
        raise _refuse("fake.helper", "through a helper")
    seconds_setting("AGENTFOLD_FAKE", 1.0, 0.1, 2.0, code="fake.keyword")
    code = "fake.assigned" if flag else EngineCode.STEP_FAILED
    raise NotFound(code, "through a name")


def record() -> Failure:
    return Failure(FailureKind.EXTERNAL, FAKE_CODE, "a recorded code")


def wrong_class() -> None:
    raise NotFound("store.url_invalid", "the documented code, with another class")
'''


@functools.cache
def scanned_with_fake() -> Scan:
    """The sources with FAKE added as one more module (scanned once for the tests below)."""
    return Scan(sources({"agentfold/adapters/fake_new_codes.py": FAKE}))


def _line(text: str) -> int:
    return next(n for n, line in enumerate(FAKE.splitlines(), 1) if text in line)


def test_an_undocumented_code_fails_the_check() -> None:
    scan = scanned_with_fake()
    missing = undocumented(scan, page())
    # execution.step.failed is on the page as a recorded code, not as a raised one
    assert set(missing) == {"fake.literal", "fake.helper", "fake.keyword", "fake.assigned", "fake.constant",
                            "execution.step.failed"}
    where = "agentfold/adapters/fake_new_codes.py"
    assert missing["fake.constant"] == [f"failure at {where}:{_line('FAKE_CODE, ')}"]
    assert missing["execution.step.failed"] == [f"raised at {where}:{_line('raise NotFound(code')}"]


def test_a_wrong_status_fails_the_check() -> None:
    scan = scanned_with_fake()
    wrong = status_mismatches(scan, page())
    assert any(w.startswith("store.url_invalid: raised with several classes") for w in wrong), wrong
    rows = [Row(r.code, r.section, ("1", "503", *r.cells[2:]) if r.code == "payload.invalid" else r.cells, r.line)
            for r in page()]
    assert any("payload.invalid documented exit 1 / HTTP 503" in w for w in status_mismatches(scanned(), rows))


def test_a_dead_row_fails_the_check() -> None:
    rows = [*page(), Row("engine.nothing.here", RAISED, ("2", "422"), 0)]
    found = codes_of(scanned())
    assert [r.code for r in rows if r.section == RAISED and r.code not in found[RAISED]] == ["engine.nothing.here"]


@pytest.mark.parametrize("section", [RAISED, FAILURE])
def test_removing_a_row_fails_the_check(section: str) -> None:
    rows = page()
    victim = next(r for r in rows if r.section == section)
    assert victim.code in undocumented(scanned(), [r for r in rows if r is not victim])


def test_an_error_raised_again_is_a_copy_with_its_code_message_hint_and_details_and_no_old_traceback() -> None:
    from agentfold.domain.errors import Fenced

    try:
        raise Fenced("engine.tree.incarnation_conflict", "another writer took the tree", "recover it there",
                     tree_id="tree:0")
    except Fenced as raised:
        kept = raised
    again = kept.again()
    assert type(again) is Fenced and again is not kept
    assert (again.code, again.message, again.hint, again.details, str(again)) == \
        (kept.code, kept.message, kept.hint, kept.details, str(kept))
    assert kept.__traceback__ is not None and again.__traceback__ is None
    assert again.__context__ is None and again.__cause__ is None
