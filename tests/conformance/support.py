"""Store wrappers and the test environment of the conformance suite.

* :class:`FaultyStore` wraps an :class:`~agentfold.adapters.eventstore.EventStore` the way
  Scope's conformance driver wraps a TreeCommitter. Every successful append is
  immediately repeated and the identical retry must succeed too (the *probe*: an
  identical retry at the head is idempotent); a failed append is never retried. One
  armed :class:`Fault` per matching append can cut it **before** the write (Scope's
  "crash before commit"), cut its answer **after** the write (the append is stored,
  the caller never gets the acknowledgement: "crash after commit"), or hold it,
  before or after the write, until the test releases it (a storage call that blocks).
* :class:`GrantAllLeases` stands in for a lost lease (an owner whose database session
  ended while its thread was still running): the store's version fence alone must
  then keep writers apart.
* Broken stores for the negative checks (group J): :class:`BlindLoadStore`,
  :class:`ConflictSwallowingStore`, :class:`ActivationWithoutCasStore`; and
  :class:`NonIdempotentStore`, which the probe itself must flag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import AppendResult, EventStore, LoadedTree, VersionConflict
from agentfold.adapters.recorders import TreeHead
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import NotFound, StoreFailure
from agentfold.domain.events import TreeEvent, WriterActivated
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Program
from agentfold.domain.tree import ProcessState, TreeState
from tests.crash.worker import GrantAllLeases  # a lease manager that grants everything: an owner whose lease was lost
from tests.kernel_programs import CallLog

CRASH_CODE = "store.crash"

# One lock for every wrapper of a test: an append and its probe retry are not
# interleaved with another writer's append (else the retry would rightly conflict).
_APPEND_LOCK = threading.RLock()


def crash(where: str) -> StoreFailure:
    return StoreFailure(CRASH_CODE, f"simulated host crash {where}")


# ---------------------------------------------------------------------------
# matching appends


Match = Callable[[Sequence[TreeEvent]], bool]


def holding(kind: type[TreeEvent], **fields: Any) -> Match:
    """Match an append that holds an event of type ``kind`` with these field values."""

    def match(events: Sequence[TreeEvent]) -> bool:
        return any(isinstance(e, kind) and all(getattr(e, k) == v for k, v in fields.items()) for e in events)

    match.__name__ = f"holding({kind.__name__}, {fields})"
    return match


@dataclass(slots=True)
class AppendCall:
    """One append as the runtime made it (enough to re-submit it verbatim)."""

    tree_id: TreeID
    expected: int
    events: list[TreeEvent]
    previous_digest: str | None
    timestamp: str
    head: TreeHead | None
    snapshot: Any = None  # the folded tree the append saves as a snapshot (read at once, while it is that version)
    digest: str | None = None

    def resubmit(self, store: Any) -> AppendResult:
        return store.append(  # type: ignore[no-any-return]
            self.tree_id,
            self.expected,
            self.events,
            previous_digest=self.previous_digest,
            timestamp=self.timestamp,
            head=self.head,
            snapshot=self.snapshot,
        )


class Fault:
    """One injected fault on the first append that ``match`` accepts."""

    MODES = ("fail_before", "fail_after", "block_before", "block_after")

    def __init__(self, match: Match, mode: str) -> None:
        assert mode in self.MODES, mode
        self.match = match
        self.mode = mode
        self.reached = threading.Event()
        self.call: AppendCall | None = None
        self._released = threading.Event()
        self._outcome = "fail"

    @property
    def events(self) -> list[TreeEvent]:
        assert self.call is not None, "the fault was not reached"
        return self.call.events

    def wait(self, timeout: float = 10.0) -> Fault:
        assert self.reached.wait(timeout), f"no append matched {self.match.__name__} within {timeout}s"
        return self

    def release(self, outcome: str = "fail") -> None:
        """Let a held append go on: ``proceed`` (it returns normally) or ``fail`` (crash error)."""
        assert outcome in ("proceed", "fail")
        self._outcome = outcome
        self._released.set()

    def _hold(self) -> str:
        self._released.wait()
        return self._outcome


class FaultyStore:
    """An EventStore wrapper: probe every successful append, inject armed faults."""

    def __init__(self, inner: Any, *, leases: bool = True, probe: bool = True) -> None:
        self.inner = inner
        self.real_leases = leases
        self.probe = probe
        self.calls: list[AppendCall] = []
        self.probe_failures: list[str] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, match: Match, mode: str) -> Fault:
        fault = Fault(match, mode)
        with self._lock:
            self._faults.append(fault)
        return fault

    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    def leases(self) -> Any:
        return self.inner.leases() if self.real_leases else GrantAllLeases()

    def _take(self, events: Sequence[TreeEvent]) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if not fault.reached.is_set() and fault.match(events):
                    fault.reached.set()
                    return fault
        return None

    def append(
        self,
        tree_id: TreeID,
        expected_version: int,
        events: Sequence[TreeEvent],
        *,
        previous_digest: str | None,
        timestamp: str,
        head: TreeHead | None = None,
        snapshot: Any = None,
    ) -> AppendResult:
        call = AppendCall(tree_id, expected_version, list(events), previous_digest, timestamp, head, snapshot)
        fault = self._take(events)
        if fault is not None:
            fault.call = call
            return self._faulted(fault, call)
        with _APPEND_LOCK:
            result = call.resubmit(self.inner)
            call.digest = result.digest
            self.calls.append(call)
            if self.probe:
                self._probe(call, result)
        return result

    def _faulted(self, fault: Fault, call: AppendCall) -> AppendResult:
        if fault.mode == "fail_before":
            raise crash("before the commit was written")
        if fault.mode == "block_before":
            if fault._hold() == "fail":
                raise crash("before the commit was written (the blocked store call was aborted)")
        with _APPEND_LOCK:
            result = call.resubmit(self.inner)
        call.digest = result.digest
        self.calls.append(call)
        if fault.mode == "fail_after":
            raise crash("after the commit was written, before its acknowledgement")
        if fault.mode == "block_after" and fault._hold() == "fail":
            raise crash("after the commit was written (the blocked acknowledgement was aborted)")
        return result

    def _probe(self, call: AppendCall, result: AppendResult) -> None:
        """Scope's global invariant: the identical retry of a successful commit succeeds."""
        try:
            again = call.resubmit(self.inner)
        except Exception as exc:  # noqa: BLE001 - any refusal breaks the invariant
            self.probe_failures.append(f"identical retry at version {call.expected} was refused: {exc!r}")
            return
        if again.digest != result.digest:
            self.probe_failures.append(f"identical retry at version {call.expected} gave another digest")


# ---------------------------------------------------------------------------
# broken stores (group J)


class _Passthrough:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class BlindLoadStore(_Passthrough):
    """Broken: loading a tree never finds its head (Scope 38: LoadTree never finds a head)."""

    def load(self, tree_id: TreeID, *args: Any, **kwargs: Any) -> LoadedTree:
        raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist")


class ConflictSwallowingStore(_Passthrough):
    """Broken: a conflicting append reports success and writes nothing (Scope 39)."""

    def append(
        self, tree_id: TreeID, expected_version: int, events: Sequence[TreeEvent], **kwargs: Any
    ) -> AppendResult:
        try:
            return self.inner.append(tree_id, expected_version, events, **kwargs)  # type: ignore[no-any-return]
        except VersionConflict:
            return AppendResult(kwargs.get("previous_digest") or "", ())


class ActivationWithoutCasStore(_Passthrough):
    """Broken: an activation that lost the race reports success anyway (Scope 40: no CAS)."""

    def append(
        self, tree_id: TreeID, expected_version: int, events: Sequence[TreeEvent], **kwargs: Any
    ) -> AppendResult:
        try:
            return self.inner.append(tree_id, expected_version, events, **kwargs)  # type: ignore[no-any-return]
        except VersionConflict:
            if any(isinstance(e, WriterActivated) for e in events):
                return AppendResult(kwargs.get("previous_digest") or "", ())
            raise


class NonIdempotentStore(_Passthrough):
    """Broken: the identical retry of the head append conflicts (the probe must notice)."""

    def append(
        self, tree_id: TreeID, expected_version: int, events: Sequence[TreeEvent], **kwargs: Any
    ) -> AppendResult:
        head = self.inner.head(tree_id)
        if head is not None and head.version > expected_version:
            raise VersionConflict(tree_id, expected_version)
        return self.inner.append(tree_id, expected_version, events, **kwargs)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# the environment of one test


@dataclass
class Env:
    """One store (``view``: what the runtimes and checks see), runtimes over it, a call log."""

    url: str
    tmp_path: Path
    broken: Callable[[Any], Any] | None = None
    store: EventStore = field(init=False)
    view: Any = field(init=False)
    log: CallLog = field(init=False)
    runtimes: list[tuple[Runtime, FaultyStore]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = EventStore(self.url)
        self.view = self.broken(self.store) if self.broken else self.store
        self.log = CallLog(self.tmp_path / f"calls-{id(self)}.jsonl")

    def runtime(self, *programs: Program, leases: bool = True) -> tuple[Runtime, FaultyStore]:
        """A Runtime (no watcher, short cancel grace) over a fresh FaultyStore wrapper."""
        faulty = FaultyStore(self.view, leases=leases)
        runtime = Runtime(
            faulty,  # type: ignore[arg-type]
            Catalog(programs),
            dispatch_workers=4,
            owner_workers=2,
            poll_interval=0,
            cancel_grace=0.5,
        )
        self.runtimes.append((runtime, faulty))
        return runtime, faulty

    # -- observation through the store (the acknowledged head) ------------------

    def load(self, tree_id: TreeID) -> TreeState:
        """The folded acknowledged head; a store that cannot find it fails the scenario."""
        try:
            loaded = self.view.load(tree_id)
        except NotFound as exc:
            raise AssertionError(f"the store found no head for {tree_id}: {exc}") from exc
        return loaded.state  # type: ignore[no-any-return]

    def events(self, tree_id: TreeID) -> list[TreeEvent]:
        return [r.event for r in self.view.read(tree_id)]

    def version(self, tree_id: TreeID) -> int:
        head = self.view.head(tree_id)
        assert head is not None, f"tree {tree_id} has no head"
        return int(head.version)

    @property
    def probe_failures(self) -> list[str]:
        return [f for _, faulty in self.runtimes for f in faulty.probe_failures]

    def close(self) -> None:
        for _, faulty in self.runtimes:
            for fault in faulty.faults():
                fault.release("fail")
        for runtime, _ in self.runtimes:
            try:
                runtime.close(timeout=10)
            except Exception:  # noqa: BLE001 - teardown must go on
                pass
        self.store.close()


def process_json(tree: TreeState, pid: str) -> dict[str, Any]:
    """One Process of a folded tree as JSON (what ``agentfold show`` prints for it)."""
    for body in tree.to_json()["processes"]:
        if body["process_id"] == pid:
            return body  # type: ignore[no-any-return]
    raise AssertionError(f"process {pid} is not in the tree")


def child_of(tree: TreeState) -> ProcessState:
    children = [p for p in tree.processes.values() if p.parent_id is not None]
    assert len(children) == 1, f"expected one child, found {len(children)}"
    return children[0]


def of_type(events: Iterable[TreeEvent], kind: type[TreeEvent], **fields: Any) -> list[TreeEvent]:
    return [e for e in events if isinstance(e, kind) and all(getattr(e, k) == v for k, v in fields.items())]


def run_in_thread(fn: Callable[[], Any]) -> Outcome:
    outcome = Outcome()

    def target() -> None:
        try:
            outcome.value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.error = exc

    outcome.thread = threading.Thread(target=target, daemon=True)
    outcome.thread.start()
    return outcome


@dataclass
class Outcome:
    """The result of a call running in another thread."""

    value: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def returned(self, within: float = 0.0) -> bool:
        assert self.thread is not None
        self.thread.join(within)
        return not self.thread.is_alive()

    def get(self, timeout: float = 15.0) -> Any:
        assert self.returned(timeout), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.value
