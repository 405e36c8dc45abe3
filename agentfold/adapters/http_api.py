"""The authenticated HTTP API over one store (docs/http-api.md): ``agentfold serve``.

One server process holds one :class:`~agentfold.adapters.eventstore.EventStore`, one
:class:`~agentfold.adapters.runtime.Runtime` that drives the runs it starts or adopts (an
answer, a steer, a resolution or a control adopts a tree nobody owns, as the CLI
does), and, on SQLite and PostgreSQL, a read-model :class:`~agentfold.adapters.follower.Follower`
thread. Reads go through :class:`~agentfold.adapters.queries.HostQueries`, so they answer
exactly the JSON entries the CLI's ``--json`` prints, from the read models when they
are current (or reached the caller's ``min_position``), else by folding.

Writes validate completely before their single append, with the same rules and the
same stable codes as the CLI commands (``answer``, ``steer``, ``resolve``, ``cancel``,
``run``); a refused write appends nothing. Errors are ``application/problem+json``
(RFC 9457) with the agentfold ``code``. Every endpoint but ``GET /health`` needs
``Authorization: Bearer <AGENTFOLD_API_TOKEN>``.
"""

from __future__ import annotations

import asyncio
import email.message
import hmac
import itertools
import json
import logging
import os
import pathlib
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Literal, get_args

import anyio.to_thread
import psycopg
from eventsourcing.persistence import PersistenceError
from fastapi import APIRouter, Body, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.cli import timers_json, tree_summary
from agentfold.adapters.eventstore import (
    EventStore,
    read_failure,
    read_only_server,
    refuses_writes,
    seconds_setting,
    sqlite_damage,
)
from agentfold.adapters.feed import held_trees_by_topic, publisher_positions
from agentfold.adapters.follower import Follower, lost_session, one_line, renew_sessions
from agentfold.adapters.host import (
    answer_signal,
    checked_resolution,
    deliver_answer,
    fresh_signal_id,
    unknown_effect_tree,
)
from agentfold.adapters.interaction import steer_signal
from agentfold.adapters.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from agentfold.adapters.metrics import Family, render
from agentfold.adapters.queries import (
    HostQueries,
    Listing,
    corrupt_tree_error,
    parse_runs_cursor,
)
from agentfold.adapters.resolution import ABSENT, settlement_for
from agentfold.adapters.runtime import DEFAULT_DISPATCH_WORKERS, RandomIds, Runtime, RuntimeStopped
from agentfold.adapters.scenario import (
    confine_side_effect_logs,
    confined_input_log,
    scenario_input,
    scenario_program,
    validate_scenario,
)
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.canonical import JSON, MAX_DEPTH, MAX_PAYLOAD_BYTES, duplicate_key, normalize
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, StoreFailure
from agentfold.domain.ids import EffectID, ProcessID, SignalID, TreeID, parse_effect_id, parse_wait_id
from agentfold.domain.program import ProgramResolver
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import CLASSIFICATIONS, STATUSES, TreeState
from agentfold.projections.read_models import Entry

API_VERSION = "1"
TOKEN_ENV = "AGENTFOLD_API_TOKEN"
PROBLEM_TYPE = "urn:agentfold:problem:"
PROBLEM_JSON = "application/problem+json"
MAX_WAIT = 300.0
"""Upper bound of a write's ``wait`` (seconds to wait for the run to park or end)."""
MAX_READ_WAIT = 60.0
DEFAULT_READ_WAIT = 5.0
"""How long a read with ``min_position`` waits for the read models before it folds."""
MAX_BODY_BYTES = MAX_PAYLOAD_BYTES * 4 + 1024
#: What a 405's ``Allow`` header may name, in this order.
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
"""Request bodies above this are refused before they are read (the CLI's JSON text bound)."""
MAX_RUNS_PAGE = 500
WORKER_THREADS = 256
"""Requests run on worker threads (they block on the store, or on ``wait``): this many at once."""
#: Threads that answer ``GET /health`` (apart from the WORKER_THREADS of every other request).
#: Each may wait up to HEALTH_PROBE_SECONDS for a store that does not answer.
HEALTH_THREADS = 64
#: A 422 ``http.request_invalid`` lists at most this many errors (``error_count`` says how many
#: there were); a name or a value it quotes is cut at ``MAX_SHOWN`` characters.
MAX_ERRORS = 20
MAX_SHOWN = 80

log = logging.getLogger("agentfold.http")

RunStatus = Literal["running", "waiting", "paused", "completed", "failed", "canceled", "timed_out", "killed"]
Classification = Literal["progress", "parked", "terminal"]
if get_args(RunStatus) != STATUSES or get_args(Classification) != CLASSIFICATIONS:  # pragma: no cover
    raise RuntimeError("the API's statuses or classifications are not the kernel's (agentfold.domain.tree)")


# ---------------------------------------------------------------------------
# Errors of the HTTP surface (everything else is the domain's own AgentfoldError)


class Unauthorized(AgentfoldError):
    """No bearer token, or not the server's."""

    exit_status = 2
    http_status = 401


class RequestInvalid(InvalidInput):
    """A request that does not say what to do (the HTTP counterpart of ``cli.usage``)."""

    def __init__(self, message: str, hint: str = "", **detail: Any) -> None:
        super().__init__("http.request_invalid", message, hint, **detail)


def problem_body(status: int, code: str, detail: str, hint: str = "", extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An RFC 9457 problem document with the agentfold code (docs/http-api.md#errors)."""
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE + code,
        "title": HTTPStatus(status).phrase,
        "status": status,
        "code": code,
        "detail": detail,
    }
    if hint:
        body["hint"] = hint
    for key, value in (extra or {}).items():
        body.setdefault(key, value)
    return body


def _dumps(value: Any) -> bytes:
    # Ids are str subclasses; anything else non-JSON in an entry is a bug, shown as text.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).encode("utf-8")


def json_response(value: Any, status: int = 200, headers: Mapping[str, str] | None = None,
                  media_type: str = "application/json") -> Response:
    return Response(_dumps(value), status_code=status, headers=dict(headers or {}), media_type=media_type)


#: The listings a hint names as CLI commands (the store's and the runtime's refusals are shared
#: with the CLI), as a client of this API reads them.
_HTTP_LISTINGS = {
    "`agentfold trees`": "GET /runs",
    "`agentfold unknown`": "GET /unknown-effects",
    "`agentfold pending`": "GET /pending-inputs",
}
_SHOW = re.compile(r"`agentfold show ([^`\s]+)`")
#: A hint that names both (the CLI's command and this API's request for the same run).
_SHOW_AND_GET = re.compile(r"`agentfold show ([^`\s]+)`, GET /runs/\1(?=[);,]|\s|$)")


def http_hint(hint: str) -> str:
    """``hint`` with the listing commands it names as this API's requests."""
    for command, request in _HTTP_LISTINGS.items():
        if request in hint:  # it names both: "(`agentfold pending`, GET /pending-inputs)"
            hint = hint.replace(f"{command}, ", "").replace(f"{command} or ", "")
        hint = hint.replace(command, request)
    return _SHOW.sub(r"GET /runs/\1", _SHOW_AND_GET.sub(r"GET /runs/\1", hint))


def problem_response(status: int, code: str, detail: str, hint: str = "", extra: Mapping[str, Any] | None = None,
                     headers: Mapping[str, str] | None = None) -> Response:
    return json_response(problem_body(status, code, detail, hint, extra), status, headers, PROBLEM_JSON)


# ---------------------------------------------------------------------------
# Request bodies (unknown members and members of the wrong JSON type are refused:
# http.request_invalid). Strict: "wait": "5" or "wait": true is a client's mistake, not
# five seconds or one; an integer is still a number of seconds.


#: The forms of ids, published in the OpenAPI document only: the server checks ids itself and
#: refuses a malformed one with 422 identity.invalid (a schema check would answer another code).
FREE_FORM_ID = r"^[A-Za-z0-9\-_.:]{1,256}$"
WAIT_ID = r"^wait:[0-9a-f]{64}$"
EFFECT_ID = r"^effect:[0-9a-f]{64}$"


def _pattern(pattern: str) -> dict[str, Any]:
    return {"pattern": pattern}


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` as an error quotes it: cut at ``limit`` characters (a caller's value can be megabytes)."""
    return text if len(text) <= limit else text[:limit] + "..."


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_members(cls, data: Any) -> Any:
        # pydantic reports every unknown member as an error of its own: a 1 MiB body of
        # {"k0": 0, "k1": 0, ...} made 87,000 errors (seconds of the event loop, megabytes
        # of answer). More than MAX_ERRORS of them are one error.
        fields = cls.model_fields
        if isinstance(data, dict) and len(data) > len(fields) + MAX_ERRORS:
            unknown = len(data) - sum(1 for name in fields if name in data)
            some = ", ".join(repr(shown(str(key))) for key in itertools.islice((k for k in data if k not in fields), 3))
            raise PydanticCustomError(
                "extra_forbidden", "{count} members are not permitted ({some}, ...); this body takes only {known}",
                {"count": unknown, "some": some, "known": ", ".join(fields)})
        return data


class StartRun(_Body):
    """Start a run: a scenario document, or a registered Program with its input."""

    scenario: dict[str, Any] | None = Field(None, description="a scenario document (docs/scenarios.md)")
    program: str | None = Field(None, description="the name of a Program this server binds (e.g. demo.payment)")
    input: Any = Field(None, description="the registered Program's input (only with program)")
    start_id: str | None = Field(None, description="idempotent start id (default: a fresh one); not tree:... or "
                                 "process:...", json_schema_extra=_pattern(FREE_FORM_ID))
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


class Answer(_Body):
    response: Any = Field(..., description="the answer; it must satisfy the wait's response schema (at most 1 MiB)")
    signal_id: str | None = Field(None, description="deduplication id (resend it to retry safely); not signal:engine:...",
                                  json_schema_extra=_pattern(FREE_FORM_ID))
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


class Steer(_Body):
    text: str | None = Field(None, description="one user message (give text or messages)")
    # fail_fast: one error for the first message that is not an object, not one per message
    # (a 1 MiB [0, 0, ...] made 524,000 errors: 12 s, 46 MB of answer).
    messages: list[dict[str, Any]] | None = Field(None, min_length=1, fail_fast=True, description="user messages")
    signal_id: str | None = Field(None, description="deduplication id (resend it to retry safely); not signal:engine:...",
                                  json_schema_extra=_pattern(FREE_FORM_ID))
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


class Resolve(_Body):
    output: Any = Field(None, description="a tool call's output (text or {content, details}), or another effect's payload")
    disposition: Literal["succeeded", "failed", "rejected"] | None = Field(None, description="tool calls only")
    model_response: Any = Field(None, description="a model call's response")
    effective_messages: list[Any] | None = Field(
        None, description="with model_response, for a program that reduces its context: the messages the model received")
    status: Literal["succeeded", "failed"] | None = Field(None, description="effects that are neither tool nor model calls")
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


class Control(_Body):
    reason: str | None = Field(None, description="why (recorded with the request)")
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


class Resume(_Body):
    wait: float = Field(0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="seconds to wait for the run to park or end")


# ---------------------------------------------------------------------------
# Response documents (for the OpenAPI document; handlers return the entries as they are)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class Problem(_Doc):
    type: str = Field(..., examples=["urn:agentfold:problem:engine.signal.rejected"])
    title: str
    status: int
    code: str = Field(..., description="the stable agentfold error code")
    detail: str
    hint: str | None = None


class Positions(_Doc):
    store: int = Field(..., description="the store's last notification id")
    read_models: int | None = Field(..., description="the read models' tracking position (null: no read models)")


class Health(_Doc):
    status: Literal["ok"]
    backend: Literal["memory", "sqlite", "postgresql"]
    follower: Literal["running", "restarting", "stopped", "off"]
    leases: Literal["ok"] = Field(..., description="the owner leases work: the PostgreSQL lease session, the SQLite lease file "
                                                 "(503 store.unavailable otherwise)")
    positions: Positions
    adopt_every: float = Field(..., description="seconds between scans for runs nobody owns (0: none)")
    orphans_adopted: int = Field(..., description="runs nobody owned that this server adopted since it started")


class TreeSummary(_Doc):
    tree_id: str
    start_id: str
    root_process_id: str
    program: str
    status: str
    classification: Classification
    version: int
    unknown_effect_ids: list[str]


class RunProcess(_Doc):
    process_id: str
    parent_id: str | None
    child_key: str | None
    program: str
    interaction: bool
    status: str
    usage: dict[str, int]
    unknown_effect_ids: list[str]


class Run(_Doc):
    tree_id: str
    start_id: str
    root_process_id: str
    program: str
    status: str
    classification: Classification
    version: int
    output: Any
    failure: dict[str, str] | None
    processes: list[RunProcess]


_NEXT_PAGE = "the cursor of the next page (null: this page is the last)"


class ListedRun(Run):
    cursor: str = Field(..., description="pass as `after` to list the runs created after this one")


class RunList(_Doc):
    runs: list[ListedRun]
    next_after: str | None = Field(..., description=_NEXT_PAGE)


class Results(_Doc):
    tree_id: str
    rounds: list[dict[str, Any]] = Field(..., description="SettledResults of every open round (docs/cli.md#results)")


class Delegates(_Doc):
    process_id: str
    found: bool = Field(..., description="false when the process is not an Interaction")
    delegates: list[dict[str, Any]] = Field(..., description="Delegate attributions (docs/cli.md#delegates)")


class PendingInput(_Doc):
    tree_id: str
    process_id: str = Field(..., description="the Tool child that waits: the process to answer")
    wait_id: str
    prompt: Any
    response_schema: Any
    tool_call_ref: str | None


class PendingList(_Doc):
    pending: list[PendingInput]


class GateInputDoc(_Doc):
    tree_id: str
    process_id: str = Field(..., description="the InputGate that waits: the process to answer")
    wait_id: str
    request: Any = Field(..., description="what the gate asks (its input)")
    answer_schema: Any
    parent_id: str | None = Field(..., description="the Process that started the gate (its team)")
    task: str | None = Field(..., description="the gate's child key under its parent (a team task key)")


class GateList(_Doc):
    gates: list[GateInputDoc]


class UnknownList(_Doc):
    unknown_effects: list[dict[str, Any]] = Field(..., description="unknown effects (docs/cli.md#unknown)")


class PendingPage(_Doc):
    pending: list[PendingInput]
    next_after: str | None = Field(..., description=_NEXT_PAGE)


class GatePage(_Doc):
    gates: list[GateInputDoc]
    next_after: str | None = Field(..., description=_NEXT_PAGE)


class UnknownPage(_Doc):
    unknown_effects: list[dict[str, Any]] = Field(
        ..., description="unknown effects (docs/cli.md#unknown)")
    next_after: str | None = Field(..., description=_NEXT_PAGE)


class CorruptTree(_Doc):
    tree_id: str
    start_id: str | None
    code: Literal["store.corrupt"]
    position: int = Field(..., description="the position in the tree's history where reading it failed")
    rule: str = Field(..., description="the rule the stored history breaks (e.g. integrity.digest_chain)")
    detail: str


class _Partial(Problem):
    """The 503 of a store-wide listing. With ``store.corrupt`` (some trees could not be read)
    it carries the listing's members for every other tree and ``corrupt_trees``; any other
    503 is a plain problem (the store is unavailable)."""

    corrupt_trees: list[CorruptTree] = Field(default_factory=list, description="with store.corrupt: the trees "
                                             "whose history could not be read; their entries are missing "
                                             "(`agentfold audit verify TREE` says what is wrong)")


class PartialPending(_Partial):
    pending: list[PendingInput] = Field(default_factory=list,
                                              description="this page's tool input waits of every other tree")
    next_after: str | None = Field(None, description=_NEXT_PAGE)


class PartialGates(_Partial):
    gates: list[GateInputDoc] = Field(default_factory=list, description="this page's InputGates of every other tree")
    next_after: str | None = Field(None, description=_NEXT_PAGE)


class PartialUnknown(_Partial):
    unknown_effects: list[dict[str, Any]] = Field(default_factory=list,
                                                  description="this page's unknown effects of every other tree")
    next_after: str | None = Field(None, description=_NEXT_PAGE)


class PartialRunList(_Partial):
    runs: list[ListedRun] = Field(default_factory=list, description="this page's runs, the unreadable trees left out")
    next_after: str | None = Field(None, description=_NEXT_PAGE)


class _Written(_Doc):
    position: int = Field(..., description="a notification id at or after this write (use as min_position)")
    idle: bool = Field(..., description="the run was parked or ended when the response was formed")
    tree: TreeSummary


class Started(_Written):
    created: bool = Field(..., description="true: this request created the run; false: the start id existed")


class Answered(_Written):
    accepted: bool = Field(..., description="false: this signal id was already admitted with this answer")
    signal_id: str
    process_id: str
    wait_id: str
    driven: bool = Field(..., description="false: another runtime owns the tree and drives it on")


class Steered(_Written):
    accepted: bool
    signal_id: str
    process_id: str
    driven: bool = Field(..., description="false: another runtime owns the tree and drives it on")


class Resolved(_Written):
    effect_id: str
    process_id: str | None
    resolution: dict[str, Any]
    driven: bool = Field(..., description="false: another runtime owns the tree and drives it on")


class Controlled(_Written):
    recorded: bool = Field(..., description="false: the same request was already recorded (nothing changed)")
    process_id: str
    driven: bool = Field(..., description="false: another runtime owns the tree and drives it on")


# ---------------------------------------------------------------------------
# The service: store, runtime, follower, queries


class _StartIds(RandomIds):
    """Fresh ids that remember, per thread, the last root process id they made.

    ``Runtime.start`` draws a root process id for every call; the run it returns has
    that id only if this call created it, so a start knows exactly whether it created
    the run or found it (also when another process started it meanwhile).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def root_process_id(self) -> ProcessID:
        pid = super().root_process_id()
        self._local.last = pid
        return pid

    def last_root(self) -> ProcessID | None:
        return getattr(self._local, "last", None)


class FollowerThread:
    """Keeps the read models current in a background thread; restarts after a failure."""

    def __init__(self, store: EventStore, sources: ProgramSources, *, retry: float = 1.0,
                 catalog: Catalog | None = None) -> None:
        """``catalog``: the server's runtime's, so a run's Programs are built and held once for
        both (else one of its own, from ``sources``)."""
        self.store = store
        self.sources = sources
        self.catalog = catalog if catalog is not None else sources.catalog()
        self.retry = retry
        self.state: Literal["running", "restarting", "stopped"] = "stopped"
        self._stop = threading.Event()
        # Created here, not in the thread, so the tables exist before the first request.
        self._follower: Follower | None = Follower(store, self.catalog)
        self._thread = threading.Thread(target=self._run, name="agentfold-follower", daemon=True)

    def start(self) -> None:
        self.state = "running"
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                follower = self._follower or Follower(self.store, self.catalog)
                self._follower = None
                self.state = "running"
                follower.follow(self._stop)
            except Exception as exc:  # noqa: BLE001 - reads fold meanwhile; try again
                self.state = "restarting"
                # As the CLI followers: new sessions once the database takes writes again (read
                # only); after a lost session, the other idle pooled sessions the server cut are
                # let go (only idle ones: those the requests hold are left alone), so the next
                # failure says what is true then, not the old disconnect text again.
                renew_sessions(exc, self.store.forget_sessions, self.store.check_sessions)
                lost = lost_session(exc)
                log.error("read-model follower failed (reads fold until it recovers): %s", one_line(exc))
                if not self._stop.wait(self.retry) and lost:
                    self.store.check_sessions()  # and those the server ended during the wait
        self.state = "stopped"

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.state = "stopped"


#: How long ``GET /health`` waits for the store to answer before it says 503.
HEALTH_PROBE_SECONDS = 2.0


def _run_into(future: Future[Any], fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - the waiting request reports it
        future.set_exception(exc)


#: How long a request waits at a time for its run or position before it looks whether the
#: server is stopping (``ApiService.stopping``).
WAIT_SLICE = 0.25
#: Seconds ``serve --recover`` waits after each run it adopts at startup (a test hook, unset
#: in production: tests/http_api/test_serve_stopping.py stops a server during that phase).
RECOVER_PAUSE_ENV = "AGENTFOLD_SERVE_RECOVER_PAUSE"


def _recover_pause() -> float:
    """``RECOVER_PAUSE_ENV`` in seconds (0 when unset or not a number from 0 to 60)."""
    try:
        pause = float(os.environ.get(RECOVER_PAUSE_ENV, "0"))
    except ValueError:
        return 0.0
    return pause if 0 <= pause <= 60 else 0.0


@dataclass
class ApiService:
    """What one server holds, and every operation its endpoints perform."""

    store: EventStore
    sources: ProgramSources
    runtime: Runtime
    ids: _StartIds
    token: str
    follower: FollowerThread | None = None
    #: The folder a scenario's side-effect logs may be in (relative ones are resolved against
    #: it); None: a scenario that names one is refused.
    side_effect_dir: pathlib.Path | None = None
    queries: HostQueries = field(init=False)
    _probes: dict[str, Future[Any]] = field(init=False, default_factory=dict)
    _probe_lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    #: Set when the server starts stopping (``stop``): requests stop waiting and answer with
    #: what is stored (a write: ``idle: false``), instead of waiting past the requests' grace.
    stopping: threading.Event = field(init=False, default_factory=threading.Event)
    #: The first ``store.damaged`` a request met (SQLite found the file damaged): ``GET /health``
    #: answers it from then on. Its own reads touch a few pages only, often cached, and a
    #: damaged file does not mend itself: it is restored from a backup (a new file, which
    #: ``check_file`` sees) and the server restarted.
    damage: StoreFailure | None = field(init=False, default=None)

    def found_damage(self, failure: StoreFailure) -> None:
        """Remember the first ``store.damaged`` a request met (see ``damage``)."""
        if failure.code == "store.damaged" and self.damage is None:
            self.damage = failure
            log.error("the store's file is damaged (GET /health answers 503 store.damaged from now on): %s",
                      failure.message)

    def __post_init__(self) -> None:
        # The runtime's catalog: a run's Programs are built once and held once, by whichever of
        # the runtime, the follower and the reads folds it (each had its own: a parked run's
        # Programs were in memory twice, and a read that folded a run rebuilt its scenario).
        self.queries = HostQueries(self.store, self.sources, catalog=self.runtime.catalog)

    @classmethod
    def open(
        cls, store: EventStore, sources: ProgramSources, token: str, *, follow: bool = True, adopt_every: float = 0.0,
        side_effect_dir: pathlib.Path | None = None, dispatch_workers: int = DEFAULT_DISPATCH_WORKERS,
    ) -> ApiService:
        """``adopt_every``: seconds between scans for runs nobody owns (a dead peer's), 0 = none;
        ``side_effect_dir``: where scenarios' side-effect logs may be (None: nowhere);
        ``dispatch_workers``: tool and model calls in flight at once (``--dispatch-workers``)."""
        ids = _StartIds()
        runtime = Runtime(store, sources.catalog(), poll_interval=0.2, ids=ids, adopt_orphans_every=adopt_every,
                          dispatch_workers=dispatch_workers)
        follower = None
        try:
            if follow and store.backend in ("sqlite", "postgresql"):
                follower = FollowerThread(store, sources, catalog=runtime.catalog)
                follower.start()
        except BaseException:
            runtime.close()
            raise
        return cls(store, sources, runtime, ids, token, follower, side_effect_dir)

    def stop(self) -> None:
        """The server starts stopping (SIGTERM or SIGINT, from a signal handler: no lock is
        waited for): no call is started any more (``Runtime.stop_dispatching``), no run is taken
        over, and the requests waiting for a run or a position answer now."""
        self.runtime.stop_dispatching()
        self.stopping.set()

    def recover(self) -> list[dict[str, Any]]:
        """Adopt every live tree nobody owns (``--recover``); one entry per live tree, until the
        server starts stopping (the others are left to the next owner: not in the list)."""
        entries: list[dict[str, Any]] = []
        for head in self.store.heads(live_only=True):
            if self.stopping.is_set():
                break
            if not self.runtime.needs_recovery(head):
                entries.append({"tree_id": head.tree_id, "outcome": "parked"})
                continue
            try:
                self.runtime.recover(head.tree_id)
                entries.append({"tree_id": head.tree_id, "outcome": "adopted"})
            except AgentfoldError as exc:
                entries.append({"tree_id": head.tree_id, "outcome": "skipped", "error": exc.to_json()})
            pause_until = time.monotonic() + _recover_pause()
            while time.monotonic() < pause_until and not self.stopping.is_set():
                # Not ``stopping.wait``: called on the main thread, a signal handler that sets the
                # event would run inside the wait, and an Event's lock is not re-entrant.
                time.sleep(0.02)
        return entries

    def close(self) -> None:
        """Stop the follower, then the runtime (in-flight dispatches are abandoned)."""
        if self.follower is not None:
            self.follower.close()
        try:
            self.runtime.close()
        except AgentfoldError as exc:
            log.error("closing the runtime: %s", exc)

    # -- reads -----------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        self._check_runs_start()
        if not self.runtime.leases_healthy():
            if self.store.backend == "sqlite":
                raise StoreFailure(
                    "store.unavailable",
                    "the store's lease file was removed or replaced and cannot be opened again: this server's owner "
                    "leases exclude no other process until it can",
                    hint="make room for <database>.leases next to the database file (free space or inodes, write "
                    "access): the server opens it again by itself and takes its leases there",
                )
            raise StoreFailure(
                "store.unavailable",
                "the owner-lease session to the store is down or does not answer: runs cannot be adopted until "
                "it is back",
                hint="the server reconnects by itself; check that PostgreSQL is reachable",
            )
        self.store.check_file()  # an SQLite file removed or replaced under the server
        if self.damage is not None:
            raise StoreFailure("store.damaged", f"a request found the store's file damaged: {self.damage.message}",
                               hint=self.damage.hint)
        positions = self._bounded("positions", self.queries.position)  # a store that is down answers 503
        if self._bounded("writes", self.store.refuses_writes_now):
            raise read_only_server("the store accepts no writes now")
        stalled = self.runtime.stalled_trees()
        last = self.runtime.last_stall
        if stalled and last is not None and last.code == "store.read_only":
            raise StoreFailure(
                "store.read_only",
                f"{len(stalled)} run(s) stopped on an append the database refused as read-only (e.g. {stalled[0]}); "
                "the server adopts them again as soon as it takes writes",
                hint=last.hint,
            )
        if stalled:
            raise StoreFailure(
                "store.append_failed",
                f"{len(stalled)} run(s) stopped on a failed append (e.g. {stalled[0]}); the server adopts them "
                "again as soon as the store takes appends",
                hint="check the store's disk space or server; `agentfold unknown` lists what the failure left unknown",
            )
        return {
            "status": "ok",
            "backend": self.store.backend,
            "follower": self.follower.state if self.follower is not None else "off",
            "leases": "ok",
            "positions": positions,
            "adopt_every": self.runtime.adopt_orphans_every,
            "orphans_adopted": self.runtime.orphans_adopted,
        }

    def _check_runs_start(self) -> None:
        """``GET /health``'s 503 while this server cannot start or drive runs: its runtime is
        closed (``POST /runs`` answers 503 ``engine.runtime.closed``) or it is stopping (it starts
        no call and takes no run over). A load balancer then sends new runs to another server."""
        if self.runtime.closed:
            raise RuntimeStopped(
                "engine.runtime.closed", "this server's runtime is closed: it starts no run and drives none "
                "(POST /runs answers 503 engine.runtime.closed)",
                hint="restart the server; another server adopts its runs",
            )
        if self.stopping.is_set():
            raise RuntimeStopped(
                "engine.runtime.draining", "this server is stopping: it starts no call and takes no run over",
                hint="send requests to another server; the runs it drove are adopted by another server or "
                "`agentfold recover`",
            )

    def metrics(self) -> str:
        """GET /metrics: this server's counters and the store's gauges, in Prometheus' text format."""
        positions, (live, with_unknown), feeds, held = self._bounded("metrics", self._store_gauges)
        runtime = self.runtime
        settled = runtime.calls_settled.snapshot()
        families = [
            Family("agentfold_runs_live", "gauge", "Runs of the store that are not terminal, by classification.",
                   [({"classification": c}, float(live.get(c, 0))) for c in ("progress", "parked")]),
            Family("agentfold_runs_with_unknown_effects", "gauge",
                   "Live runs of the store holding an unknown Effect (a host must resolve it).",
                   [({}, float(with_unknown))]),
            Family("agentfold_store_position", "gauge", "Notification id of the store's last event.",
                   [({}, float(positions["store"]))]),
        ]
        if positions["read_models"] is not None:
            families += [
                Family("agentfold_read_models_position", "gauge", "Notification id the read models reflect.",
                       [({}, float(positions["read_models"]))]),
                Family("agentfold_read_models_lag", "gauge", "Events of the store the read models do not reflect yet.",
                       [({}, float(positions["store"] - positions["read_models"]))]),
            ]
        if feeds:
            families += [
                Family("agentfold_feed_position", "gauge", "Notification id a Kafka publisher has published, by topic.",
                       [({"topic": t}, float(p)) for t, p in sorted(feeds.items())]),
                Family("agentfold_feed_lag", "gauge", "Events of the store past a Kafka publisher's position (the events "
                       "of trees it holds back are behind it: agentfold_feed_held_trees).",
                       [({"topic": t}, float(max(0, positions["store"] - p))) for t, p in sorted(feeds.items())]),
                Family("agentfold_feed_held_trees", "gauge", "Corrupt trees whose records a Kafka publisher holds "
                       "back from its topic (agentfold audit verify TREE says what is wrong).",
                       [({"topic": t}, float(held.get(t, 0))) for t in sorted(feeds)]),
            ]
        families += [
            Family("agentfold_runs_owned", "gauge", "Runs this server drives now.", [({}, float(runtime.owned_count()))]),
            Family("agentfold_runs_stalled", "gauge", "Runs this server stopped driving on a failed append.",
                   [({}, float(len(runtime.stalled_trees())))]),
            Family("agentfold_calls_running", "gauge", "Dispatcher calls (tools, models) in flight in this server.",
                   [({}, float(runtime.dispatches_running()))]),
            Family("agentfold_timers_waiting", "gauge", "Timers (a Deadline's) waiting for their instant in this "
                   "server; they hold no call slot.", [({}, float(runtime.timers_waiting()))]),
            Family("agentfold_calls_limit", "gauge", "The most dispatcher calls this server has in flight at once "
                   "(--dispatch-workers).", [({}, float(runtime.dispatch_workers))]),
            Family("agentfold_runs_waiting_for_calls", "gauge", "Runs whose next call waits for one of the "
                   "--dispatch-workers to be free.", [({}, float(runtime.runs_waiting_for_calls()))]),
            Family("agentfold_leases_healthy", "gauge", "1 when this server's owner leases work, else 0.",
                   [({}, 1.0 if runtime.leases_healthy() else 0.0)]),
            Family("agentfold_calls_settled_total", "counter",
                   "Dispatcher calls this server made, by outcome (unknown: a host must resolve it).",
                   [({"outcome": o}, float(settled.get(o, 0))) for o in ("succeeded", "failed", "unknown")]),
            Family("agentfold_appends_total", "counter", "Appends this server committed.",
                   [({}, float(runtime.appends))]),
            Family("agentfold_events_appended_total", "counter", "Events this server appended.",
                   [({}, float(runtime.events_appended))]),
            Family("agentfold_orphans_adopted_total", "counter",
                   "Runs nobody owned that this server's periodic scan adopted (--adopt-every).",
                   [({}, float(runtime.orphans_adopted))]),
            Family("agentfold_runs_recovered_total", "counter",
                   "Live runs this server took over with recover (serve --recover at startup).",
                   [({}, float(runtime.recovered))]),
            Family("agentfold_append_seconds", "histogram",
                   "Time of an append (events, index row, any snapshot: one transaction) in this server.",
                   histogram=runtime.append_seconds),
        ]
        return render(families)

    def _store_gauges(self) -> tuple[dict[str, Any], tuple[dict[str, int], int], dict[str, int], dict[str, int]]:
        positions = self.queries.position()
        try:
            return positions, self.store.count_live(), publisher_positions(self.store), held_trees_by_topic(self.store)
        except Exception as exc:
            raise read_failure(exc, "counting the live runs") from exc

    def _bounded(self, name: str, read: Callable[[], Any]) -> Any:
        """What ``read`` reads from the store, or 503 within ``HEALTH_PROBE_SECONDS`` whatever the
        store does (GET /health's positions, GET /metrics' counts).

        A read waits up to 30 s for a pooled PostgreSQL connection while the server is down,
        and a probe must not hang that long. One read of each ``name`` at a time: while one is
        still waiting, later probes wait for it (at most the same bound), none piles up behind it.
        """
        with self._probe_lock:
            probe = self._probes.get(name)
            if probe is None or probe.done():
                probe = self._probes[name] = Future()
                threading.Thread(target=_run_into, args=(probe, read), daemon=True, name=f"agentfold-{name}").start()
        try:
            return probe.result(timeout=HEALTH_PROBE_SECONDS)
        except FutureTimeout:
            raise StoreFailure(
                "store.unavailable", f"the store did not answer within {HEALTH_PROBE_SECONDS:g} s",
                hint="check that the store is reachable; the server reconnects by itself",
            ) from None

    def _reach(self, min_position: int | None, wait: float) -> None:
        """Wait (bounded) for the read models to reflect ``min_position``; else listings fold
        what the tables lack. (A read about one run never waits: it folds that run alone
        when the tables are behind it, see ``HostQueries._rows``.)"""
        if min_position is None or wait <= 0 or self.follower is None:
            return
        models = self.queries.read_models()
        deadline = time.monotonic() + wait
        while models is not None and not self.stopping.is_set():
            # In slices, so that a server that starts stopping answers now, not after the wait.
            left = deadline - time.monotonic()
            if models.wait_for(min_position, max(0.0, min(left, WAIT_SLICE))) or left <= WAIT_SLICE:
                return

    def runs(self, *, status: str | None, classification: str | None, limit: int, after: str | None,
             min_position: int | None, wait: float) -> dict[str, Any]:
        """Runs in creation order, a page at a time (``m``/``f`` cursors: ``HostQueries.runs_page``)."""
        if parse_runs_cursor(after)[0] in (None, "m"):
            self._reach(min_position, wait)
        page = self.queries.runs_page(status=status, classification=classification, limit=limit, after=after,
                                      min_position=min_position)
        return _complete({"runs": list(page), "next_after": page.next_after}, page, "runs")

    def run(self, ref: str, min_position: int | None, wait: float) -> Entry:
        tree_id = self.queries.tree_of(ref)
        return self.queries.run(tree_id, min_position=min_position)  # never older than the run's head

    def results(self, ref: str, min_position: int | None, wait: float) -> Entry:
        tree_id = self.queries.tree_of(ref)
        return self.queries.results(tree_id, min_position=min_position)  # never older than the run's head

    def delegates(self, process_id: str, min_position: int | None, wait: float) -> Entry:
        ProcessID(process_id)  # identity.invalid before any lookup
        return self.queries.delegates(process_id, min_position=min_position)

    def gates(self, ref: str) -> dict[str, Any]:
        return {"gates": self.queries.gates(self.queries.tree_of(ref))}

    def pending(self, ref: str, min_position: int | None, wait: float) -> dict[str, Any]:
        # one run: its answer reflects its head, nothing to wait for
        return {"pending": self.queries.pending(self.queries.tree_of(ref), min_position=min_position)}

    def unknown(self, ref: str, min_position: int | None, wait: float) -> dict[str, Any]:
        return {"unknown_effects": self.queries.unknown(self.queries.tree_of(ref), min_position=min_position)}

    def pending_page(self, limit: int, after: str | None, min_position: int | None, wait: float) -> dict[str, Any]:
        """A page of every run's tool input waits, runs in creation order (``m``/``f`` cursors as ``runs``)."""
        self._reach(min_position, wait)
        page = self.queries.pending_page(limit=limit, after=after, min_position=min_position)
        return _complete({"pending": page, "next_after": page.next_after}, page, "tool input waits")

    def gates_page(self, limit: int, after: str | None, min_position: int | None, wait: float) -> dict[str, Any]:
        """A page of every run's InputGates that wait for an answer, runs in creation order."""
        self._reach(min_position, wait)
        page = self.queries.gates_page(limit=limit, after=after, min_position=min_position)
        return _complete({"gates": page, "next_after": page.next_after}, page, "InputGates")

    def unknown_page(self, limit: int, after: str | None, min_position: int | None, wait: float) -> dict[str, Any]:
        self._reach(min_position, wait)
        page = self.queries.unknown_page(limit=limit, after=after, min_position=min_position)
        return _complete({"unknown_effects": page, "next_after": page.next_after}, page, "unknown effects")

    # -- writes ----------------------------------------------------------------

    def _tree_of_process(self, process_id: ProcessID) -> TreeID:
        return self.store.find_process_tree(process_id)

    def _written(self, tree_id: TreeID, wait: float, *, driven: bool = False, **data: Any) -> dict[str, Any]:
        """The answer to a write: the tree after waiting up to ``wait`` s, and a position.

        A run left with nothing under way but timers due after the wait (a Deadline's) is
        parked until their instants: answered at once, ``idle``, its ``timers`` listed.
        ``driven``: the answer says whether this server drives the run, after the wait (input
        recorded beside a lease held for a moment is taken over at its next polls, which the
        wait covers)."""
        drive_error = None
        timers: list[tuple[EffectID, float]] = []
        deadline = time.monotonic() + wait
        while True:
            # In slices, so that a server that starts stopping answers now with what is stored
            # (``idle: false``), not after the requests' grace with a bare 500 (uvicorn cancels
            # the request): the write is recorded either way.
            left = deadline - time.monotonic()
            try:
                # Timers due before the whole wait's end are waited for (``horizon``), not taken
                # for timers due after it because a slice ends before them.
                tree, timers = self.runtime.wait_quiet(tree_id, max(0.001, min(left, WAIT_SLICE)), horizon=deadline)
                idle = tree.classification() != "progress" or bool(timers)
                if not idle and left > WAIT_SLICE and not self.stopping.is_set() and self.runtime.taking_over(tree_id):
                    # Recorded beside a lease held for a moment: this server takes the run over at
                    # its next polls (Runtime._take_over_recorded), within the wait.
                    continue
            except TimeoutError:
                if left > WAIT_SLICE and not self.stopping.is_set():
                    continue
                tree, idle = self.runtime.capture(tree_id), False
            except AgentfoldError as exc:  # the write is recorded; driving it on failed here
                tree, idle, drive_error = self.queries.fold(tree_id)[0], False, exc.to_json()
            break
        body = {**data, "tree": tree_summary(tree), "idle": idle, "position": self.store.max_notification_id()}
        if timers:
            body["timers"] = timers_json(timers)
        if drive_error is not None:
            body["drive_error"] = drive_error
        if driven:
            body["driven"] = self.runtime.drives(tree_id)
        return body

    def start(self, body: StartRun) -> tuple[dict[str, Any], bool]:
        if (body.scenario is None) == (body.program is None):
            raise RequestInvalid("give either scenario (a scenario document) or program (a registered Program name)")
        if body.scenario is not None:
            if "input" in body.model_fields_set:
                raise RequestInvalid("a scenario carries its own input (its input member); drop input")
            doc = validate_scenario(body.scenario, base_dir=self.side_effect_dir)
            # A scenario's tools append to its side-effect log inside this server: only where
            # the operator allowed (any path the server could write to, before).
            confine_side_effect_logs(doc, self.side_effect_dir)
            program = scenario_program(doc)
            run_input: JSON = scenario_input(doc)
            configuration: JSON = doc
        else:
            assert body.program is not None
            found = self.sources.named(body.program)
            if found is None:
                raise NotFound("engine.program.unavailable", f"this server binds no Program named {body.program!r}",
                               hint="start a scenario, or a Program the server was started with")
            program, run_input, configuration = found, normalize(body.input, what="input"), None
            if isinstance(run_input, dict) and "side_effect_log" in run_input:
                # The bound kernel demo appends to the file its input names: confined like a scenario's log.
                run_input = {**run_input, "side_effect_log": confined_input_log(
                    run_input["side_effect_log"], "input.side_effect_log", self.side_effect_dir)}
        if body.start_id is not None:
            handle = self.runtime.start(program, run_input, start_id=body.start_id, configuration=configuration)
        else:
            handle = self.runtime.start(program, run_input, configuration=configuration)
        created = handle.root_process_id == self.ids.last_root()
        return self._written(handle.tree_id, body.wait, created=created), created

    def answer(self, process_id: str, wait_id: str, body: Answer) -> dict[str, Any]:
        """``agentfold answer``: validated against the wait's schema and 1 MiB, then admitted."""
        pid, wid = ProcessID(process_id), parse_wait_id(wait_id)
        sid = SignalID(body.signal_id) if body.signal_id is not None else None
        tree_id = self._tree_of_process(pid)
        tree, programs = self.queries.fold(tree_id)
        signal = answer_signal(tree, programs, pid, wid, body.response, sid,
                               listing_hint="list pending inputs with GET /pending-inputs")
        accepted = deliver_answer(self.runtime, tree_id, pid, signal)
        return self._written(tree_id, body.wait, driven=True, accepted=accepted, signal_id=signal.id, process_id=pid,
                             wait_id=wid)

    def steer(self, process_id: str, body: Steer) -> dict[str, Any]:
        """``agentfold steer``: user messages for the Interaction's next model request."""
        if (body.text is None) == (body.messages is None):
            raise RequestInvalid("give either text (one user message) or messages")
        pid = ProcessID(process_id)
        messages = [{"role": "user", "content": body.text}] if body.text is not None else list(body.messages or [])
        # Only an absent signal_id means "make one up" (as answer, the CLI and Host.steer):
        # "" is an invalid id (identity.invalid), else each resend would be a new steer.
        signal_id = SignalID(body.signal_id) if body.signal_id is not None else fresh_signal_id("steer")
        signal = steer_signal(signal_id, *messages)
        tree_id = self._tree_of_process(pid)
        accepted = self.runtime.deliver_signals(pid, [signal])
        return self._written(tree_id, body.wait, driven=True, accepted=accepted, signal_id=signal.id, process_id=pid)

    def resolve(self, effect_id: str, body: Resolve) -> dict[str, Any]:
        """``agentfold resolve``: validated on a private fold first, then settled."""
        eid = parse_effect_id(effect_id)
        tree_id = unknown_effect_tree(self.store, eid, listing_hint="list unknown effects with GET /unknown-effects")
        probe, programs = self.queries.fold(tree_id)
        settlement = resolution_settlement(body, probe, programs, eid)
        # The kernel's own rules on a private copy: a refused resolution must not even
        # make this server take ownership (WriterActivated).
        process_id = checked_resolution(probe, eid, settlement)
        self.runtime.resolve_unknown_effect(eid, settlement, process_id=process_id)
        return self._written(
            tree_id, body.wait, driven=True, effect_id=eid, process_id=process_id,
            resolution={"status": settlement.status.value, "payload": settlement.payload},
        )

    def control(self, process_id: str, control: Literal["cancel", "pause", "resume"], reason: str | None,
                wait: float) -> dict[str, Any]:
        """``agentfold cancel`` (and pause, resume): record the request, then drive on."""
        pid = ProcessID(process_id)
        tree_id = self._tree_of_process(pid)
        if control == "cancel":
            recorded = self.runtime.cancel(pid, "canceled by host" if reason is None else reason)
        elif control == "pause":
            recorded = self.runtime.pause(pid, "paused by host" if reason is None else reason)
        else:
            recorded = self.runtime.resume(pid)
        return self._written(tree_id, wait, driven=True, recorded=recorded, process_id=pid)


def _complete(body: dict[str, Any], listing: Listing, missing: str) -> dict[str, Any]:
    """A store-wide listing's answer, or, when some tree's history could not be read, a 503
    ``store.corrupt`` whose problem document carries the same members (the entries of every
    other tree) plus ``corrupt_trees``: the answer is incomplete, so it is not a 200, and
    one damaged tree does not hide the others (docs/http-api.md#a-corrupt-tree-in-a-listing)."""
    if not listing.corrupt:
        return body
    for entry in listing.corrupt:
        log.warning("listing %s: %s", missing, corrupt_tree_error(entry).message)
    trees = ", ".join(f"{e['tree_id']} (position {e['position']}: {e['rule']})" for e in listing.corrupt)
    raise StoreFailure(
        "store.corrupt",
        f"{len(listing.corrupt)} tree(s) could not be read, so their {missing} are missing from this answer: {trees}",
        hint="the other members list every other tree; `agentfold audit verify TREE` says what is wrong",
        **body, corrupt_trees=list(listing.corrupt),
    )


def resolution_settlement(
    body: Resolve, tree: TreeState, programs: ProgramResolver | None, effect_id: EffectID
) -> Settlement:
    """The definite settlement a resolution body describes (``agentfold resolve``'s rules)."""
    given = body.model_fields_set
    return settlement_for(
        tree, programs, effect_id,
        model_response=normalize(body.model_response, what="model_response") if "model_response" in given else ABSENT,
        effective_messages=normalize(body.effective_messages, what="effective_messages")
        if "effective_messages" in given else ABSENT,
        output=normalize(body.output, what="output") if "output" in given else ABSENT,
        disposition=body.disposition, status=body.status,
        usage=RequestInvalid, wrong_kind=RequestInvalid,
    )


# ---------------------------------------------------------------------------
# The application


_bearer = HTTPBearer(auto_error=False, description=f"the server's token (${TOKEN_ENV})")


def _service(request: Request) -> ApiService:
    service: ApiService | None = request.app.state.service
    if service is None:  # an app built only for its OpenAPI document
        raise AgentfoldError("http.unavailable", "this application serves no store")
    return service


def token_refusal(authorization: str, token: str) -> Unauthorized | None:
    """Why an ``Authorization`` header value does not carry the server's bearer token (None
    when it does): the one check of the dependency, the early middleware and ``/health``."""
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()  # as FastAPI's HTTPBearer reads it
    hint = f"send the token the server was started with (${TOKEN_ENV})"
    if scheme.lower() != "bearer" or not credentials:
        return Unauthorized("http.unauthorized", "this endpoint needs Authorization: Bearer <token>", hint=hint)
    if not hmac.compare_digest(credentials.encode("utf-8"), token.encode("utf-8")):
        return Unauthorized("http.unauthorized", "the bearer token is not this server's", hint=hint, invalid_token=True)
    return None


def unauthorized_response(error: Unauthorized) -> Response:
    challenge = 'Bearer error="invalid_token"' if error.details.get("invalid_token") else "Bearer"
    return problem_response(401, error.code, error.message, error.hint, headers={"WWW-Authenticate": challenge})


def authorized(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> ApiService:
    """The service, for a request that carries the server's bearer token (``credentials``:
    declared for the OpenAPI document's security scheme)."""
    service = _service(request)
    refusal = token_refusal(request.headers.get("authorization", ""), service.token)
    if refusal is not None:
        raise refusal
    return service


Service = Annotated[ApiService, Depends(authorized)]



def not_utf8(body: bytes) -> RequestInvalid | None:
    """Why a JSON body is not UTF-8 (None when it is).

    The parser (``json.loads`` on bytes) detects UTF-16 and UTF-32 on its own and decodes
    UTF-8 with ``surrogatepass``, so such a body was taken although the API takes UTF-8
    only (RFC 8259: JSON exchanged between systems is UTF-8). One UTF-8 byte order mark at
    the start is ignored, as the RFC allows and the parser does: it is still UTF-8."""
    hint = "send one JSON object encoded as UTF-8"
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        # Checked first: UTF-16 of ASCII text is also valid UTF-8 (with NUL bytes).
        return RequestInvalid(f"the request body is not UTF-8 JSON: it is encoded as {encoding.upper()}", hint)
    try:
        body.decode("utf-8")  # strict: no encoded surrogates
    except UnicodeDecodeError as exc:
        return RequestInvalid(f"the request body is not UTF-8 JSON: {exc.reason} at byte {exc.start}", hint)
    return None


def _read_as_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body with this Content-Type as JSON (its own rule; without a
    Content-Type it does not: ``strict_content_type``, its default). Another body is refused
    for its Content-Type (``request_invalid``), whatever its bytes: that is what to fix first."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _body_problem(body: bytes, as_json: bool) -> RequestInvalid | None:
    """A write body's encoding problem or repeated key (``distinct_keys``), if any."""
    if as_json:
        refusal = not_utf8(body)
        if refusal is not None:
            return refusal
    duplicate = duplicate_key(body)
    if duplicate is None:
        return None
    path, key = duplicate
    return RequestInvalid(f"body: {path} has the key {key!r} twice",
                          "send each key once (JSON parsers keep only the last one, silently)")


async def distinct_keys(request: Request, service: Service) -> None:
    """Refuse a write whose JSON body is not UTF-8, or has a key twice in one object (after
    the token check, before the handler).

    The JSON parser keeps the last of two equal keys without a word: ``{"wait": 0, ...,
    "wait": 30}`` or a scenario with two ``tools`` members would be taken as something the
    client did not write. It also reads UTF-16 and UTF-32 (``not_utf8``)."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    types = request.headers.getlist("content-type")
    if len(types) > 1:
        # A field that must appear once (RFC 9110): FastAPI reads the first, a proxy in front
        # may go by the last, and the body would be taken for what the client did not send.
        raise RequestInvalid(f"the request has {len(types)} Content-Type headers",
                             "send one: Content-Type: application/json")
    body = await request.body()  # Starlette keeps it: the handler reads the same bytes
    # A worker thread: the check parses the body once more (seconds for 16 MiB of small
    # values), and the event loop must stay free for other requests (GET /health above all).
    as_json = _read_as_json(request.headers.get("content-type"))
    problem = await anyio.to_thread.run_sync(_body_problem, body, as_json) if body else None
    if problem is not None:
        raise problem


PageLimit = Annotated[int, Query(ge=1, le=MAX_RUNS_PAGE, description="at most this many runs per page (listings of entries: entries, whole runs only, unless one run alone has more)")]
PageAfter = Annotated[str | None, Query(description="a cursor from a previous page")]
#: The largest position a store can hold (SQLite INTEGER, PostgreSQL bigint); a larger
#: min_position was passed to SQLite as is and answered 500 (OverflowError).
MAX_POSITION = (1 << 63) - 1
MinPosition = Annotated[
    int | None, Query(ge=0, le=MAX_POSITION, description="answer only once the reads reflect this position")
]
ReadWait = Annotated[float, Query(ge=0, le=MAX_READ_WAIT, allow_inf_nan=False, description="seconds to wait for the read models to "
                                  "reach min_position before answering by folding")]
TreeRef = Annotated[str, Path(description="a tree id (tree:...), a start id or a process id",
                              json_schema_extra=_pattern(FREE_FORM_ID))]
ProcessRef = Annotated[str, Path(description="a process id (process:...)", json_schema_extra=_pattern(FREE_FORM_ID))]

_PROBLEMS = {
    401: "no or a wrong bearer token",
    404: "not found (code says what)",
    409: "refused by the current state (code says why)",
    413: "request body too large",
    422: "invalid request (code says what)",
    503: "the store is unavailable",
    504: "timed out",
    500: "internal error",
}


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": Problem, "description": _PROBLEMS[s]} for s in (401, 422, 503, 504, 500, *statuses)}


def _ok(model: type[BaseModel], description: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": model, "description": description}}


def _partial(model: type[BaseModel], entries: str) -> dict[int | str, dict[str, Any]]:
    """A store-wide listing's 503: the store is unavailable, or some trees could not be read."""
    return {503: {"model": model, "description": f"the store is unavailable (a problem), or some trees could not be "
                  f"read (store.corrupt): the {entries} of every other tree, and corrupt_trees"}}


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "Content Too Large")


class BodyLimit:
    """Refuses request bodies above ``MAX_BODY_BYTES``: a declared length at once, a streamed
    (chunked) body as soon as it grows past the limit; both as ``payload.too_large``."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await problem_response(413, "payload.too_large", f"the request body is above {self.limit} bytes")(
                scope, receive, send)
            return
        total = 0

        async def counted() -> Message:
            nonlocal total
            message = await receive()
            total += len(message.get("body", b""))
            if total > self.limit:
                raise _BodyTooLarge()  # rendered by the HTTP error handler, like any 413
            return message

        await self.app(scope, counted, send)


class BearerFirst:
    """Refuses a request without the server's bearer token before anything else of it is read.

    The ``authorized`` dependency runs only once FastAPI has received and parsed the body:
    a client without a token could make the server read and parse 16 MiB bodies (~280 MB of
    memory and a third of a second of the event loop each) before its 401. Here the header
    is checked first; the dependency still checks it again for every endpoint."""

    def __init__(self, app: ASGIApp, service: ApiService | None, public: frozenset[str] = frozenset({"/health"})) -> None:
        self.app = app
        self.service = service
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.service is None or scope.get("path") in self.public:
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        refusal = token_refusal(header.decode("latin-1"), self.service.token)  # as Starlette decodes headers
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await unauthorized_response(refusal)(scope, receive, send)


#: A connection must send a request's head within this many seconds of being opened (or of
#: its previous response; ``AGENTFOLD_HTTP_HEAD_WAIT``), and the request's body within
#: ``REQUEST_BODY_SECONDS`` more (``AGENTFOLD_HTTP_BODY_WAIT``); else it is closed. uvicorn
#: itself waits forever for a first request and for a partial one.
REQUEST_HEAD_SECONDS = 10.0
REQUEST_BODY_SECONDS = 60.0


def request_read_deadlines() -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (h11) with deadlines for reading each request.

    Without them a client that opened connections and sent nothing, half a header or part
    of a declared body held each one (and its file descriptor) for good: a few thousand
    such connections from anyone who could reach the port left no descriptor for real
    clients (``GET /health`` timed out) and flooded stderr with asyncio's accept errors."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    head = seconds_setting("AGENTFOLD_HTTP_HEAD_WAIT", REQUEST_HEAD_SECONDS, 0.1, 3600, code="http.setting_invalid")
    body = seconds_setting("AGENTFOLD_HTTP_BODY_WAIT", REQUEST_BODY_SECONDS, 0.1, 3600, code="http.setting_invalid")

    class DeadlineH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None
        _reading_body = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm(head)

        def _arm(self, seconds: float) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
            self._read_deadline = self.loop.call_later(seconds, self._read_too_slow)

        def _read_too_slow(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY and not self._reading_body:
                self._reading_body = True  # the head arrived in time: the body gets its own time
                self._arm(body)
            elif state in (h11.IDLE, h11.SEND_BODY):
                self.transport.close()  # the app (if a request started) sees a disconnect

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._reading_body = False
                self._arm(head)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None
            super().connection_lost(exc)

    return DeadlineH11Protocol


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Writes may wait for their run (up to MAX_WAIT s) on a worker thread; anyio's
    # default of 40 threads would let 40 such waits starve every other request.
    anyio.to_thread.current_default_thread_limiter().total_tokens = WORKER_THREADS
    # GET /health has threads of its own: WORKER_THREADS long-polls (reads with min_position,
    # writes with wait) held every worker thread, and a liveness probe waited behind them.
    app.state.health_limiter = anyio.CapacityLimiter(HEALTH_THREADS)
    yield


def create_app(service: ApiService | None = None) -> FastAPI:
    """The FastAPI application; ``service`` None builds it for its OpenAPI document only."""
    app = FastAPI(
        lifespan=_lifespan,
        title="agentfold",
        version=API_VERSION,
        summary="Durable agent runs: start, answer, steer, resolve, control and read them.",
        description="The authenticated HTTP API of `agentfold serve` (docs/http-api.md). Every endpoint but "
        "`GET /health` needs `Authorization: Bearer <token>`. Errors are `application/problem+json` with a "
        "stable `code`. Reads accept `min_position` (read your own writes); writes answer a `position`.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=lambda route: route.name,
        # A path with a trailing slash is not found (a problem document), not redirected: the
        # redirect named an absolute http:// URL, which behind a TLS proxy sends clients to
        # plain HTTP.
        redirect_slashes=False,
    )
    app.state.service = service
    app.add_middleware(BodyLimit)
    app.add_middleware(BearerFirst, service=service)  # added last: runs first
    _install_error_handlers(app)

    @app.get("/health", tags=["health"], summary="store reachable, runs can start; positions (no token needed)",
             responses={**_ok(Health, "the server is up"), 503: _problems()[503], 500: _problems()[500]})
    # HEAD: the same check and status with no body, for probes that send HEAD (not in the
    # OpenAPI document, which lists each operation once).
    @app.head("/health", include_in_schema=False)
    async def health(request: Request) -> Response:
        service = _service(request)
        limiter = getattr(request.app.state, "health_limiter", None)
        try:
            return json_response(await anyio.to_thread.run_sync(service.health, limiter=limiter))
        except (StoreFailure, RuntimeStopped) as exc:
            if token_refusal(request.headers.get("authorization", ""), service.token) is None:
                raise
            # No token needed here: say what (the code), not where (store paths, server addresses).
            raise StoreFailure(exc.code, "the server is not healthy now",
                               hint="send the server's bearer token to GET /health for the reason") from None

    api = APIRouter(responses=_problems(), dependencies=[Depends(distinct_keys)])

    @api.get("/openapi.json", tags=["health"], summary="this API's OpenAPI document",
             responses={200: {"description": "the OpenAPI document", "content": {"application/json": {}}}})
    def openapi(service: Service, request: Request) -> Response:
        return json_response(request.app.openapi())

    @api.get("/metrics", tags=["health"], summary="counters and gauges for Prometheus (text format 0.0.4)",
             responses={200: {"description": "the metrics", "content": {METRICS_CONTENT_TYPE: {}}},
                        503: _problems()[503]})
    def metrics(service: Service) -> Response:
        return Response(service.metrics(), media_type=METRICS_CONTENT_TYPE)

    # -- reads ---------------------------------------------------------------

    @api.get("/runs", tags=["runs"], summary="runs in creation order, a page at a time",
             responses={**_ok(RunList, "a page of runs"), **_partial(PartialRunList, "runs")})
    def list_runs(service: Service, status: RunStatus | None = None, classification: Classification | None = None,
                  limit: PageLimit = 100, after: PageAfter = None,
                  min_position: MinPosition = None, wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.runs(status=status, classification=classification, limit=limit, after=after,
                                          min_position=min_position, wait=wait))

    @api.get("/runs/{tree}", tags=["runs"], summary="one run: status per process, output, failure, usage",
             responses={**_ok(Run, "the run"), **_problems(404)})
    def get_run(service: Service, tree: TreeRef, min_position: MinPosition = None,
                wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.run(tree, min_position, wait))

    @api.get("/runs/{tree}/results", tags=["runs"], summary="SettledResults of every open round",
             responses={**_ok(Results, "the rounds"), **_problems(404)})
    def get_results(service: Service, tree: TreeRef, min_position: MinPosition = None,
                    wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.results(tree, min_position, wait))

    @api.get("/runs/{tree}/pending-inputs", tags=["pending inputs"], summary="the run's tool input waits",
             responses={**_ok(PendingList, "current tool input waits"), **_problems(404)})
    def get_run_pending(service: Service, tree: TreeRef, min_position: MinPosition = None,
                        wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.pending(tree, min_position, wait))

    @api.get("/runs/{tree}/gates", tags=["runs"], summary="the run's InputGates that wait for an answer",
             responses={**_ok(GateList, "InputGates waiting for an answer"), **_problems(404)})
    def get_run_gates(service: Service, tree: TreeRef) -> Response:
        return json_response(service.gates(tree))

    @api.get("/runs/{tree}/unknown-effects", tags=["unknown effects"], summary="the run's unknown effects",
             responses={**_ok(UnknownList, "unknown effects of live processes"), **_problems(404)})
    def get_run_unknown(service: Service, tree: TreeRef, min_position: MinPosition = None,
                        wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.unknown(tree, min_position, wait))

    @api.get("/processes/{process_id}/delegates", tags=["processes"],
             summary="which child process each delegated tool call started",
             responses={**_ok(Delegates, "Delegate attributions"), **_problems(404)})
    def get_delegates(service: Service, process_id: ProcessRef, min_position: MinPosition = None,
                      wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.delegates(process_id, min_position, wait))

    @api.get("/pending-inputs", tags=["pending inputs"],
             summary="every tool input wait, runs in creation order, a page at a time",
             responses={**_ok(PendingPage, "a page of current tool input waits"),
                        **_partial(PartialPending, "tool input waits")})
    def get_pending(service: Service, limit: PageLimit = 100, after: PageAfter = None,
                    min_position: MinPosition = None, wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.pending_page(limit, after, min_position, wait))

    @api.get("/gates", tags=["pending inputs"],
             summary="every InputGate that waits for an answer, runs in creation order, a page at a time",
             responses={**_ok(GatePage, "a page of InputGates waiting for an answer"),
                        **_partial(PartialGates, "InputGates")})
    def get_gates(service: Service, limit: PageLimit = 100, after: PageAfter = None,
                  min_position: MinPosition = None, wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.gates_page(limit, after, min_position, wait))

    @api.get("/unknown-effects", tags=["unknown effects"],
             summary="every unknown effect of the live runs, a page at a time",
             responses={**_ok(UnknownPage, "a page of unknown effects of live processes"),
                        **_partial(PartialUnknown, "unknown effects")})
    def get_unknown(service: Service, limit: PageLimit = 100, after: PageAfter = None,
                    min_position: MinPosition = None, wait: ReadWait = DEFAULT_READ_WAIT) -> Response:
        return json_response(service.unknown_page(limit, after, min_position, wait))

    # -- writes --------------------------------------------------------------

    @api.post("/runs", tags=["runs"], summary="start a run (idempotent by start id)",
              responses={**_ok(Started, "created", 201), **_ok(Started, "the start id existed: the same run"),
                         **_problems(404, 409, 413)})
    def start_run(service: Service, body: StartRun) -> Response:
        data, created = service.start(body)
        return json_response(data, 201 if created else 200)

    @api.post("/processes/{process_id}/waits/{wait_id}/answer", tags=["pending inputs"],
              summary="answer a pending tool input or an InputGate's wait (validated against its schema)",
              responses={**_ok(Answered, "admitted, or a resend of an admitted answer"), **_problems(404, 409, 413)})
    def answer(service: Service, process_id: ProcessRef,
               wait_id: Annotated[str, Path(description="the wait to answer (wait:...)", json_schema_extra=_pattern(WAIT_ID))],
               body: Answer) -> Response:
        return json_response(service.answer(process_id, wait_id, body))

    @api.post("/processes/{process_id}/steer", tags=["processes"],
              summary="user messages for an Interaction's next model request",
              responses={**_ok(Steered, "admitted, or a resend"), **_problems(404, 409, 413)})
    def steer(service: Service, process_id: ProcessRef, body: Steer) -> Response:
        return json_response(service.steer(process_id, body))

    @api.post("/unknown-effects/{effect_id}/resolve", tags=["unknown effects"],
              summary="settle an unknown effect with the outcome the host established",
              responses={**_ok(Resolved, "resolved"), **_problems(404, 409, 413)})
    def resolve(service: Service, effect_id: Annotated[str, Path(description="an effect id (effect:...)",
                                                                 json_schema_extra=_pattern(EFFECT_ID))],
                body: Resolve) -> Response:
        return json_response(service.resolve(effect_id, body))

    @api.post("/processes/{process_id}/cancel", tags=["processes"], summary="cancel a process and its subtree",
              responses={**_ok(Controlled, "recorded"), **_problems(404, 409, 413)})
    def cancel(service: Service, process_id: ProcessRef, body: Annotated[Control | None, Body()] = None) -> Response:
        body = body or Control()
        return json_response(service.control(process_id, "cancel", body.reason, body.wait))

    @api.post("/processes/{process_id}/pause", tags=["processes"], summary="pause a running or waiting process",
              responses={**_ok(Controlled, "recorded"), **_problems(404, 409, 413)})
    def pause(service: Service, process_id: ProcessRef, body: Annotated[Control | None, Body()] = None) -> Response:
        body = body or Control()
        return json_response(service.control(process_id, "pause", body.reason, body.wait))

    @api.post("/processes/{process_id}/resume", tags=["processes"], summary="resume a paused process",
              responses={**_ok(Controlled, "recorded"), **_problems(404, 409, 413)})
    def resume(service: Service, process_id: ProcessRef, body: Annotated[Resume | None, Body()] = None) -> Response:
        body = body or Resume()
        return json_response(service.control(process_id, "resume", None, body.wait))

    app.include_router(api)
    _install_openapi(app)
    return app


def _install_openapi(app: FastAPI) -> None:
    """Problems are documented as ``application/problem+json`` only (what the server sends)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            for operations in document.get("paths", {}).values():
                for operation in operations.values():
                    for status, response in operation.get("responses", {}).items():
                        content = response.get("content", {})
                        if int(status) >= 400 and "application/json" in content:
                            response["content"] = {PROBLEM_JSON: content["application/json"]}
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    Handler = Callable[[Request, Any], Awaitable[Response]]

    async def agentfold_error(request: Request, exc: AgentfoldError) -> Response:
        if isinstance(exc, Unauthorized):
            return unauthorized_response(exc)
        service: ApiService | None = getattr(request.app.state, "service", None)
        if isinstance(exc, StoreFailure) and service is not None:
            service.found_damage(exc)
        return problem_response(exc.http_status, exc.code, exc.message, http_hint(exc.hint), exc.members())

    async def request_invalid(request: Request, exc: RequestValidationError) -> Response:
        found = exc.errors()
        for e in found:
            if e.get("type") == "json_invalid":
                # FastAPI says "body.1: JSON decode error": where, and what, is in its context.
                ctx = e.get("ctx") or {}
                where = e.get("loc", ("body", "?"))[-1]
                return problem_response(
                    422, "http.request_invalid",
                    f"the request body is not valid JSON: {ctx.get('error', 'JSON decode error')} at character {where}",
                    "send one JSON object (Content-Type: application/json)",
                )
            if tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes):
                # FastAPI parses a body as JSON only when its Content-Type says JSON; any other
                # (or none) reached the model as bytes: "Input should be a valid dictionary".
                given = request.headers.get("content-type")
                return problem_response(
                    422, "http.request_invalid",
                    "the request body was not read as JSON: its Content-Type is "
                    + (repr(shown(given)) if given is not None else "missing"),
                    "send Content-Type: application/json with one JSON object",
                )
        # At most MAX_ERRORS, each name cut at MAX_SHOWN characters; error_count: how many.
        errors = [
            {"location": [shown(str(part)) for part in e.get("loc", ())], "message": shown(str(e.get("msg", "invalid")), 400)}
            for e in found[:MAX_ERRORS]
        ]
        first = errors[0] if errors else {"location": [], "message": "invalid request"}
        detail = f"{'.'.join(first['location']) or 'request'}: {first['message']}"
        if len(found) > 1:
            detail += f" (and {len(found) - 1} more)"
        return problem_response(422, "http.request_invalid", detail, "see the OpenAPI document (/openapi.json)",
                                {"errors": errors, "error_count": len(found)})

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:
            # FastAPI could not parse the body (e.g. JSON nested beyond the parser's depth): a
            # request that does not say what to do, as any other unreadable body (422).
            if isinstance(exc.__cause__, UnicodeDecodeError):
                return problem_response(422, "http.request_invalid",
                                        f"the request body is not UTF-8 JSON: {exc.__cause__.reason} at byte "
                                        f"{exc.__cause__.start}", "send one JSON object encoded as UTF-8")
            return problem_response(422, "http.request_invalid", f"the request body could not be read: {exc.detail}",
                                    f"send one JSON object whose payloads nest at most {MAX_DEPTH} levels deep")
        code = {404: "http.not_found", 405: "http.method_not_allowed", 413: "payload.too_large"}.get(
            exc.status_code, "http.error")
        detail = {404: f"no endpoint {request.url.path}",
                  405: f"{request.method} is not allowed on {request.url.path}",
                  413: f"the request body is above {MAX_BODY_BYTES} bytes"}.get(exc.status_code, str(exc.detail))
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette names only the methods of the first route whose path matched (GET /runs
            # answered "Allow: GET" although POST /runs exists): every route of this path counts.
            methods = [
                method
                for method in HTTP_METHODS
                if any(
                    route.matches({**request.scope, "method": method})[0] is Match.FULL
                    for route in request.app.router.routes
                    if isinstance(route, BaseRoute)
                )
            ]
            headers = {**(headers or {}), "Allow": ", ".join(methods)}
        return problem_response(exc.status_code, code, detail, headers=headers)

    async def timed_out(request: Request, exc: TimeoutError) -> Response:
        return problem_response(504, "http.timeout", str(exc) or "timed out",
                                "the request may still take effect; read the run to see")

    async def store_unavailable(request: Request, exc: Exception) -> Response:
        # A store error that reached the HTTP layer unclassified (a dropped connection, a
        # server restart): the request did not take effect, or its outcome is unknown.
        log.warning("store error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        damaged = sqlite_damage(exc) or (read_only_server("the store refused a write") if refuses_writes(exc) else None)
        if damaged is not None:  # retrying does not help: the operator restores the file or moves the URL
            service: ApiService | None = getattr(request.app.state, "service", None)
            if service is not None:
                service.found_damage(damaged)
            return problem_response(503, damaged.code, damaged.message, damaged.hint)
        return problem_response(503, "store.unavailable", f"the store failed ({type(exc).__name__})",
                                "retry; read the run first if the request may have taken effect")

    async def internal(request: Request, exc: Exception) -> Response:
        # The server logs the traceback (uvicorn's "Exception in ASGI application"); the
        # client only learns that it happened.
        return problem_response(500, "http.internal", f"internal error ({type(exc).__name__})",
                                "the server logged the details")

    handlers: list[tuple[type[Exception], Handler]] = [
        (AgentfoldError, agentfold_error),
        (RequestValidationError, request_invalid),
        (StarletteHTTPException, http_error),
        (TimeoutError, timed_out),
        (PersistenceError, store_unavailable),
        (psycopg.Error, store_unavailable),
        (Exception, internal),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document the server serves (committed as docs/openapi.json)."""
    return create_app(None).openapi()


def openapi_text() -> str:
    """docs/openapi.json, byte for byte (``scripts/openapi`` writes it)."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"


__all__ = [
    "ApiService",
    "FollowerThread",
    "Unauthorized",
    "create_app",
    "openapi_document",
    "openapi_text",
    "problem_body",
    "resolution_settlement",
]
