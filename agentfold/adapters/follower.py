"""The read-model follower: folds the notification log into the read-model tables.

It reads the store's notification log (every event of every tree, in commit order)
after its tracking position, folds each touched tree forward (trees stay folded in a
bounded cache, so a batch costs the new events plus one projection per touched tree),
recomputes that tree's rows with the pure projections (``agentfold.projections.read_models``)
and writes them with the new tracking position in one transaction
(``agentfold.adapters.read_models``). Nothing else is ever written, so the tables are a pure
function of the log up to the tracking position: a follower that dies at any point
resumes from the last committed position, and ``rebuild`` reproduces the same rows.
Several followers on one store (``serve`` and ``project --follow``) take turns: the write
compares and sets the position, so a batch read from a position another follower has
committed past since writes nothing, and that follower goes on from the committed one.

A tree whose history cannot be read (``CorruptStream``: a broken digest chain, an event
that does not decode or that the fold refuses) does not stop the others: the batch goes
on without it and records it in ``agentfold_rm_corrupt_trees`` (dropping whatever rows it
had) in the same transaction; its later events are skipped (an append-only history that
is corrupt at position p stays corrupt). Each is reported once, when its batch commits
(``on_corrupt``; by default a warning on the ``agentfold.follower`` logger).

SQLite followers poll (``poll_interval``); PostgreSQL followers LISTEN on the channel
every append notifies (``agentfold_events``) and also poll, as a safety net.

``follow_until_stopped`` keeps following through store failures (a restarted or
failed-over server, terminated sessions, a dropped network): it reports each failure,
waits (backing off), and goes on with a new follower from the committed tracking position.
Its policy, ``retry_until_stopped``, is shared by the Kafka publisher and the transcript
consumer (``agentfold.adapters.feed``, ``agentfold.adapters.transcripts``), and so is ``StopGuard``, which bounds
the time a following command takes to exit after SIGTERM/SIGINT, also during an outage.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from eventsourcing.persistence import InterfaceError, Notification, OperationalError

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import DecodeError
from agentfold.adapters.eventstore import CorruptStream, EventStore, causes, read_only_refusal, refuses_writes
from agentfold.adapters.read_models import CorruptTree, PositionMoved, ReadModels, TreeUpdate, crash_hook_from_env
from agentfold.adapters.recorders import EVENTS_TABLE, psycopg_error
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, StoreFailure
from agentfold.domain.events import TreeStarted
from agentfold.domain.ids import TreeID
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import FoldError, TreeState
from agentfold.projections.read_models import project_tree

log = logging.getLogger("agentfold.follower")


@dataclass(slots=True)
class _Folded:
    state: TreeState
    digest: str | None
    programs: ProgramResolver | None
    created_position: int


@dataclass(frozen=True, slots=True)
class BatchReport:
    """One committed batch: the notifications it consumed (those of corrupt trees included,
    which are not applied), the trees it updated, its position, and the trees it found corrupt."""

    events: int
    trees: int
    position: int
    corrupt: tuple[CorruptTree, ...] = ()


def corrupt_tree_line(found: CorruptTree) -> str:
    """The one line that reports a tree the follower found corrupt (logs, ``project`` stderr)."""
    start = f" (start {found.start_id})" if found.start_id else ""
    detail = " ".join(found.detail.split())  # a decoder's or driver's message may span lines
    return (
        f"tree {found.tree_id}{start} is corrupt at position {found.position}: {found.rule}: {detail}; "
        f"the read models skip it from notification {found.found_at} on "
        f"(see `agentfold audit verify {found.tree_id}`)"
    )


def unbound_tree_line(tree_id: str, program: str) -> str:
    """The one line that reports a tree projected without its Program."""
    return (
        f"tree {tree_id} runs program {program!r}, which this process does not bind: its rows hold the kernel's "
        "view only (no pending inputs, rounds or delegates; unknown effects without their requests); project "
        "with a console script that binds it (docs/python.md), then `project --rebuild`"
    )


def _log_unbound(line: str) -> None:
    log.warning("read models: %s", line)


def _log_corrupt(found: CorruptTree) -> None:
    log.warning("read models: %s", corrupt_tree_line(found))


#: The longest poll interval a follower takes (30 days): a PostgreSQL follower re-checks every
#: 10 x the interval, and a longer wait overflowed the platform's clock once it followed.
MAX_POLL_INTERVAL = 30 * 86400.0


def check_poll_interval(seconds: object, code: str) -> None:
    """Refuse (``code``) a poll interval that is no number of seconds above 0 and at most
    ``MAX_POLL_INTERVAL`` (NaN, a bool, text); the read-model follower's and the publisher's."""
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds <= MAX_POLL_INTERVAL):
        raise InvalidInput(code, f"poll interval {seconds!r} must be a number of seconds above 0 and at most "
                                 f"{MAX_POLL_INTERVAL:.0f} (30 days)")


class Follower:
    """Keeps one store's read models current."""

    def __init__(
        self,
        store: EventStore,
        catalog: Catalog | None = None,
        read_models: ReadModels | None = None,
        *,
        batch_size: int = 1000,
        cache_trees: int = 1024,
        poll_interval: float = 0.05,
        on_corrupt: Callable[[CorruptTree], None] | None = None,
        on_unbound: Callable[[str], None] | None = None,
    ) -> None:
        """``on_corrupt`` is called once per tree this follower finds corrupt, after the batch
        that records it committed (default: a warning on the ``agentfold.follower`` logger).
        ``on_unbound`` is called (with a one-line report) once per tree whose Program this
        follower's catalog does not bind (same default)."""
        if batch_size < 1:
            raise InvalidInput("projection.batch_invalid", f"batch size {batch_size} must be at least 1")
        check_poll_interval(poll_interval, "projection.poll_interval_invalid")
        self.store = store
        self.catalog = catalog or Catalog()
        self.read_models = read_models or ReadModels(store)
        self.batch_size = batch_size
        self.cache_trees = cache_trees
        self.poll_interval = poll_interval
        self._cache: collections.OrderedDict[TreeID, _Folded] = collections.OrderedDict()
        self._position = self.read_models.position()
        self._batches = 0
        self._crash = crash_hook_from_env()
        self.events_applied = 0
        self.steps = 0  # steps that ended without an error (the store answered): progress, for the backoff
        self.on_corrupt = on_corrupt or _log_corrupt
        # Trees recorded corrupt (by any follower): their later events are skipped.
        self._corrupt: set[str] = {c.tree_id for c in self.read_models.corrupt_trees()}
        self.corrupt_found: list[CorruptTree] = []  # found (and committed) by this follower
        self.on_unbound = on_unbound or _log_unbound
        self._unbound: set[TreeID] = set()  # reported already

    @property
    def position(self) -> int:
        return self._position

    # -- one batch -------------------------------------------------------------

    def step(self) -> BatchReport:
        """Project the next batch of notifications (at most ``batch_size``)."""
        notifications = self.store.notifications(self._position, self.batch_size)
        if not notifications:
            self.steps += 1
            return BatchReport(0, 0, self._position)
        by_tree: dict[TreeID, list[Notification]] = {}
        for n in notifications:
            tree_id = TreeID.from_uuid(n.originator_id if isinstance(n.originator_id, uuid.UUID) else uuid.UUID(str(n.originator_id)))
            by_tree.setdefault(tree_id, []).append(n)
        updates: list[TreeUpdate] = []
        corrupt: list[CorruptTree] = []
        # Read after the batch: each tree's index row reaches at least the batch's events (an
        # append writes both in one transaction); an event past it was added by hand.
        anchors = self.store.anchors(list(by_tree))
        for tree_id, items in by_tree.items():
            if str(tree_id) in self._corrupt:
                continue  # corrupt at an earlier position: every later event is unreadable too
            try:
                updates.append(self._advance(tree_id, items, anchors.get(tree_id)))
            except CorruptStream as exc:
                # One damaged tree must not stop every other tree's read models: record it
                # with this batch (a function of the log and of the index rows, which an honest
                # store only moves forward: a rebuild records it again).
                self._cache.pop(tree_id, None)
                corrupt.append(self._corrupt_tree(tree_id, items, exc))
        last = notifications[-1].id
        self._batches += 1
        try:
            self.read_models.write(updates, last, after=self._position, corrupt=corrupt,
                                   before_commit=self._crash(self._batches))
        except PositionMoved:
            # Another follower (or a rebuild's reset) moved the position since this batch was
            # read: nothing of it was written. Start again from the tables' position. The
            # cache stays: each folded tree is a fold of the (immutable) log up to its own
            # version, whoever committed it, and a tree whose next event is not the one after
            # that version is loaded again (``_advance``).
            self._position = self.read_models.position()
            self._corrupt = {c.tree_id for c in self.read_models.corrupt_trees()}
            self.steps += 1
            return BatchReport(0, 0, self._position)
        except BaseException:
            self._cache.clear()  # the folded trees are ahead of what was committed
            raise
        self._position = last
        self.events_applied += len(notifications)
        self.steps += 1
        for found in corrupt:
            self._corrupt.add(found.tree_id)
            self.corrupt_found.append(found)
            self.on_corrupt(found)  # once: committed, so no follower finds it again
        return BatchReport(len(notifications), len(updates), last, tuple(corrupt))

    def _corrupt_tree(self, tree_id: TreeID, items: Sequence[Notification], exc: CorruptStream) -> CorruptTree:
        """The record of a tree that ``exc`` says cannot be read, found at this batch's ``items``."""
        found_at = next((n.id for n in items if n.originator_version == exc.position), items[0].id)
        created = items[0].id if items[0].originator_version == 1 else self.read_models.created_position(str(tree_id))
        head = self.store.head(tree_id)
        return CorruptTree(str(tree_id), head.start_id if head is not None else None, created, exc.position,
                           exc.rule, str(exc.detail), found_at)

    def _advance(self, tree_id: TreeID, items: Sequence[Notification], anchor: tuple[int, str] | None) -> TreeUpdate:
        first = items[0].originator_version
        folded = self._cache.get(tree_id)
        if folded is None or folded.state.version != first - 1:
            folded = self._load(tree_id, first - 1, items)
        else:
            self._cache.move_to_end(tree_id)
        try:
            self._apply(tree_id, folded, items, anchor)
        except FoldError:
            if folded.programs is None:
                raise
            # The current Programs refuse this history (the code changed since it was
            # recorded: see `agentfold audit drift`). Project the kernel's own view of
            # the tree, as host queries do, rather than stopping every tree's read models.
            self._cache.pop(tree_id, None)
            folded = self._load(tree_id, first - 1, items, bind=False)
            self._apply(tree_id, folded, items, anchor)
        if folded.state.terminal:
            # A finished run rarely gets another event (a late resolution): one that does is
            # folded again from the store. Its state and Programs need not be kept meanwhile,
            # nor that it was reported unbound (kept for good, one per such run ever followed).
            self._cache.pop(tree_id, None)
            self._unbound.discard(tree_id)
        return TreeUpdate(project_tree(folded.state, folded.programs), len(items), folded.created_position)

    def _apply(self, tree_id: TreeID, folded: _Folded, items: Sequence[Notification],
               anchor: tuple[int, str] | None) -> None:
        for n in items:
            try:
                record = self.store.mapper.decode(tree_id, n, folded.digest)
            except DecodeError as exc:
                self._cache.pop(tree_id, None)
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            problem = self.store.past_anchor(tree_id, record.position, record.digest, anchor)
            if problem is not None:
                self._cache.pop(tree_id, None)
                raise problem
            try:
                folded.state.apply(record.event, record.position)
            except FoldError as exc:
                self._cache.pop(tree_id, None)
                if folded.programs is not None:
                    raise
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            folded.digest = record.digest

    def _load(self, tree_id: TreeID, upto: int, items: Sequence[Notification], *, bind: bool = True) -> _Folded:
        """Fold a tree up to ``upto`` (empty when the batch starts it) and cache it."""
        first: Any
        if upto <= 0:  # the batch starts the tree (a row below position 1, written by hand, fails its fold)
            try:
                first = self.store.mapper.decode(tree_id, items[0], None).event
            except DecodeError as exc:
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            created = items[0].id
        else:
            read = self.store.first_event(tree_id)
            first = read.event if read is not None else None
            # From the log, not the tables: a rebuild's reset may have emptied them just now
            # (0), and this fold outlives a batch that loses its compare-and-set (the cache
            # stays): its rows were then written with the run at the head of every listing.
            starts = self.store.tree_notifications(tree_id, 1, 1)
            created = starts[0].id if starts else 0
        programs = self._programs(tree_id, first) if bind else None
        if upto <= 0:
            state, digest = TreeState(programs), None
        else:
            try:
                loaded = self.store.load(tree_id, programs, upto=upto)
            except CorruptStream:
                if programs is None:
                    raise
                programs = None  # the current Programs refuse the history: the kernel's view
                loaded = self.store.load(tree_id, None, upto=upto)
            state, digest = loaded.state, loaded.digest
        folded = _Folded(state, digest, programs, created)
        self._cache[tree_id] = folded
        while len(self._cache) > self.cache_trees:
            self._cache.popitem(last=False)
        return folded

    def _programs(self, tree_id: TreeID, started: Any) -> ProgramResolver | None:
        """The tree's Programs when this follower's catalog binds them, else the kernel's view
        (reported once: the tree's Interaction rows are then missing from the tables, and
        every reader trusts the tables)."""
        if not isinstance(started, TreeStarted):
            return None
        try:
            program = self.catalog.load(started.program, started.configuration)
        except NotFound:
            if tree_id not in self._unbound:
                self._unbound.add(tree_id)
                self.on_unbound(unbound_tree_line(str(tree_id), started.program.name))
            return None
        return self.catalog.bound(program)  # held by the folded tree in the cache, no longer

    # -- loops -----------------------------------------------------------------

    def catch_up(self, stop: threading.Event | None = None,
                 on_batch: Callable[[BatchReport], None] | None = None) -> int:
        """Project everything committed so far; returns the number of events applied.

        ``stop``: once it is set, return after the batch in progress (committed with its
        position), caught up or not: a command stopped by SIGTERM/SIGINT. ``on_batch``:
        called after each committed batch."""
        total = 0
        while stop is None or not stop.is_set():
            report = self.step()
            total += report.events
            if on_batch is not None:
                on_batch(report)
            if report.events < self.batch_size and self._position >= self.store.max_notification_id():
                break
        return total

    def rebuild(self, stop: threading.Event | None = None,
                on_batch: Callable[[BatchReport], None] | None = None) -> int:
        """Empty the tables and project the whole log again from position zero (until ``stop``
        is set, as ``catch_up``: a later ``catch_up`` goes on from where it stopped)."""
        self.read_models.reset()
        self._cache.clear()
        self._corrupt.clear()  # found again (and recorded again) from the log
        self._position = 0
        return self.catch_up(stop, on_batch)

    def follow(self, stop: threading.Event, on_batch: Callable[[BatchReport], None] | None = None) -> None:
        """Project new events as they are committed, until ``stop`` is set."""
        if stop.is_set():
            return  # not even a LISTEN session: stopping must not wait for a server
        waiter = NewEvents(self.store, self.poll_interval)
        try:
            while not stop.is_set():
                before = self._position
                report = self.step()
                if report.events:
                    if on_batch is not None:
                        on_batch(report)
                    continue
                if self._position != before:
                    continue  # another follower committed first: there may be more to do at once
                waiter.wait(stop)
        finally:
            waiter.close()


@dataclass(frozen=True, slots=True)
class FollowReport:
    events: int
    position: int
    failures: int


#: Failures of a connection, not of what was asked: a later attempt may not meet them.
_CONNECTION_FAILURES: tuple[type[BaseException], ...] = (
    OperationalError, InterfaceError, ConnectionError, TimeoutError, sqlite3.OperationalError,
)


def _connection_failure(exc: BaseException) -> bool:
    """One of ``_CONNECTION_FAILURES``, or psycopg's (only loaded on a PostgreSQL store)."""
    return isinstance(exc, _CONNECTION_FAILURES) or psycopg_error(exc, "OperationalError", "InterfaceError")


def store_failed(exc: BaseException) -> bool:
    """A failure of the store that a new attempt may not meet (a restarted or failed-over server,
    a terminated session, a dropped network, a locked SQLite file): the error or one of its
    causes is a connection failure, or the store could not be reached (``store.unavailable``).

    Not retried: a corrupt stream (final), and what a retry meets again: a missing table or
    function, a privilege the role lacks, refused data (one stderr line every 30 s for ever
    would hide them: the command stops and says why).
    """
    for cause in causes(exc):
        if isinstance(cause, CorruptStream):
            return False
        if _connection_failure(cause):
            return True
        if isinstance(cause, StoreFailure) and cause.code == "store.unavailable":
            return True
        if read_only_refusal(cause) or (isinstance(cause, StoreFailure) and cause.code == "store.read_only"):
            # A standby or a database set read-only (maintenance, a failover on its way): it
            # takes writes again once promoted or switched back (``renew`` gives new sessions).
            return True
    return False


def lost_session(exc: BaseException) -> bool:
    """Whether ``exc`` (or one of its causes) is a session the database server ended or lost
    (``_CONNECTION_FAILURES``, psycopg's), not a pooled connection that could not be had."""
    pool = sys.modules.get("psycopg_pool")  # loaded only on a PostgreSQL store
    for cause in causes(exc):
        if pool is not None and isinstance(cause, pool.PoolTimeout):
            return False  # no connection could be had (``NoConnection``): none was lost
        if _connection_failure(cause):
            return True
    return False


def renew_sessions(exc: BaseException, renew: Callable[[], None] | None,
                   recheck: Callable[[], None] | None) -> None:
    """What a following loop does to its store's pooled sessions after the failure ``exc``:
    ``renew`` them after a write the database refused as read-only (``refuses_writes``: a
    session keeps that setting for its life, ``EventStore.forget_sessions``), ``recheck``
    them after a lost session (``lost_session``: the other idle sessions of a server that
    shut down or restarted were cut too, ``EventStore.check_sessions``); nothing otherwise.
    Shared by ``retry_until_stopped`` and ``serve``'s read-model follower thread."""
    if renew is not None and refuses_writes(exc):
        renew()
    elif recheck is not None and lost_session(exc):
        recheck()


def retry_until_stopped(
    attempt: Callable[[], None],
    stop: threading.Event,
    say: Callable[[str], None],
    *,
    retryable: Callable[[BaseException], bool] = store_failed,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    on_failure: Callable[[], None] | None = None,
    progress: Callable[[], int] | None = None,
    renew: Callable[[], None] | None = None,
    recheck: Callable[[], None] | None = None,
) -> int:
    """Run ``attempt`` until ``stop`` is set, again after each failure ``retryable`` accepts;
    returns how many failures there were.

    ``attempt`` works until ``stop`` is set (and returns) or raises; each new attempt must go
    on from its own durable position (what it committed), never from memory. A retryable
    failure is reported with ``say`` as one line (``following failed: <what>; retrying in
    N s``, whitespace runs of the error's text collapsed) and the next attempt starts after a
    wait that doubles from ``backoff`` up to ``max_backoff``. ``stop`` is looked at at least
    every 0.25 s while waiting. Any other exception is raised at once.

    The wait is back to ``backoff`` only after an attempt that made **progress** (a new outage,
    not the same one): ``progress`` is a count that grows as the work goes on (a step that
    reached the store and ended without an error), read before and after each attempt. Time
    alone is not progress: during an outage each attempt may wait 30 s for a connection before
    it fails, and the wait must still grow (0.5, 1, 2, 4 ... 30 s). Without ``progress`` (a
    caller with no such count), an attempt that lasted longer than ``max_backoff`` counts as
    progress.

    A retryable failure met once ``stop`` is set ends the loop (one line, ``stopping; ...``;
    not counted): no attempt follows, and it may be the store call that ``StopGuard``
    interrupted. ``on_failure`` is called for each failure counted, as it is counted (a
    command's report at the last resort, ``exit_at_once``, shows them so far). ``renew`` is
    called after a write the database refused as read-only (``refuses_writes``): the store's
    pooled sessions keep that setting for their life (``EventStore.forget_sessions``).
    ``recheck`` is called after a lost session (``lost_session``): the other idle pooled
    sessions of a server that shut down or restarted are cut too, and each next attempt would
    take one of them and fail again with the same old disconnect text ("terminating connection
    due to administrator command") while the server stays down; the broken ones let go
    (``EventStore.check_sessions``), the next attempt connects anew and says what is true
    then (no connection: the server is down or unreachable), and the pool holds no more
    sessions after the outage than before (``renew_sessions``). ``recheck`` is called again
    at the end of the wait, before the next attempt: a shutting-down server's backends do
    not all end at once, and an idle session that still answered the first check may have
    been cut since.
    """
    failures = 0
    delay = backoff
    while not stop.is_set():
        started = time.monotonic()
        done_before = progress() if progress is not None else 0
        try:
            attempt()
            return failures
        except Exception as exc:
            if not retryable(exc):
                raise
            if stop.is_set():
                say(f"stopping; the attempt in progress failed: {one_line(exc)}")
                return failures
            failures += 1
            renew_sessions(exc, renew, recheck)
            lost = lost_session(exc)
            if on_failure is not None:
                on_failure()
            if progress is not None:
                progressed = progress() > done_before
            else:
                progressed = time.monotonic() - started > max_backoff
            if progressed:
                delay = backoff  # it had been working: a new outage starts with a short wait
            say(f"following failed: {one_line(exc)}; retrying in {delay:g} s")
            deadline = time.monotonic() + delay
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                stop.wait(min(left, 0.25))  # a signal handler sets stop; look at least every 0.25 s
            if lost and recheck is not None and not stop.is_set():
                recheck()  # and those the server ended during the wait (CI run166: a shutdown's stragglers)
            delay = min(delay * 2, max_backoff)
    return failures


class FollowProgress:
    """What ``follow_until_stopped`` did so far. ``report()`` may be read from another thread
    while it runs: the report a command prints at the last resort (``exit_at_once``)."""

    def __init__(self, first: Follower | None = None) -> None:
        self._lock = threading.Lock()
        self._current = first
        self._earlier = 0  # events applied by the followers before the current one
        self._position = first.position if first is not None else 0
        self._failures = 0

    def following(self, follower: Follower) -> None:
        """``follower`` goes on from here (the one before it is done)."""
        with self._lock:
            if self._current is not None and self._current is not follower:
                self._earlier += self._current.events_applied
                self._position = self._current.position
            self._current = follower

    def failed(self) -> None:
        with self._lock:
            self._failures += 1

    def report(self) -> FollowReport:
        with self._lock:
            current = self._current
            if current is None:
                return FollowReport(self._earlier, self._position, self._failures)
            return FollowReport(self._earlier + current.events_applied, current.position, self._failures)


def follow_until_stopped(
    make: Callable[[], Follower],
    stop: threading.Event,
    say: Callable[[str], None],
    *,
    first: Follower | None = None,
    progress: FollowProgress | None = None,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
) -> FollowReport:
    """Follow until ``stop`` is set, through store failures (``retry_until_stopped``).

    A failure of the store (or of the LISTEN connection) is reported with ``say`` (one
    line) and, after the backoff, a new follower made by ``make`` goes on from the tables'
    committed tracking position: a batch is committed with its position or not at all, so
    nothing is applied twice or skipped. A corrupt tree is not a failure: the follower
    records and skips it (``Follower.on_corrupt`` reports it). Any other error (refused
    input, a bug) is not retried: it is raised. ``progress`` (made with ``first``) shows
    what it did so far to another thread.

    The wait between attempts doubles for as long as the attempts make no progress (no
    follower step ends without an error: ``Follower.steps``), however long each one took to
    fail, and is back to ``backoff`` after an attempt that did.
    """
    progress = progress or FollowProgress(first)
    pending = first
    current: list[Follower] = []  # the follower of the attempt in progress (or of the last one)
    earlier = 0  # steps of the followers before it

    def attempt() -> None:
        nonlocal pending, earlier
        follower = pending
        if follower is None:
            follower = make()
            say(f"following again from position {follower.position}")
        pending = None  # whatever happens next, the next attempt starts with a new follower
        if current:
            earlier += current.pop().steps
        current.append(follower)
        progress.following(follower)
        follower.follow(stop)

    def steps() -> int:
        """Steps every follower ended without an error: it grows only while the store answers."""
        return earlier + (current[0].steps if current else 0)

    def renew() -> None:
        if current:
            current[0].store.forget_sessions()

    def recheck() -> None:
        if current:
            current[0].store.check_sessions()

    retry_until_stopped(attempt, stop, say, backoff=backoff, max_backoff=max_backoff, on_failure=progress.failed,
                        progress=steps, renew=renew, recheck=recheck)
    return progress.report()


def one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, AgentfoldError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


class NewEvents:
    """Waiting for new events in a store's log, for its followers (read models, publisher).

    PostgreSQL: woken by the NOTIFY every append sends, re-checking every 10 x
    ``poll_interval`` as a safety net; SQLite: polling every ``poll_interval``. Either
    way ``stop`` is looked at at least every 0.25 s (a signal cannot interrupt the wait).
    """

    def __init__(self, store: EventStore, poll_interval: float) -> None:
        self.poll_interval = poll_interval
        self._listener = _Listener(store) if store.backend == "postgresql" else None

    def wait(self, stop: threading.Event) -> None:
        if self._listener is None:
            stop.wait(self.poll_interval)
            return
        deadline = time.monotonic() + self.poll_interval * 10
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._listener.wait(min(left, 0.25)):
                return

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()


class _Listener:
    """LISTEN on the channel every PostgreSQL append notifies."""

    def __init__(self, store: EventStore) -> None:
        # A session of the store's own: ``EventStore.interrupt`` ends it with the pooled ones.
        self._conn = store.session(listen=True)
        try:
            self._conn.execute(f"LISTEN {EVENTS_TABLE}")
        except BaseException:
            self._conn.close()
            raise

    def wait(self, timeout: float) -> bool:
        """True at the first notification, False after ``timeout``. Notifications that queue
        up meanwhile each wake one more step, which finds nothing new: cheap, and never late."""
        for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            return True
        return False

    def close(self) -> None:
        self._conn.close()


# ---------------------------------------------------------------------------
# Stopping within a bound

#: Seconds a following command goes on after SIGTERM/SIGINT to end its batch by itself.
STOP_GRACE = 5.0
#: Seconds after SIGTERM/SIGINT by which a following command has exited in any case.
STOP_LIMIT = 12.0


class StopGuard:
    """Bounds the time a command takes to end once ``stop`` is set (SIGTERM, SIGINT).

    A following command looks at ``stop`` between batches, so in normal operation it ends
    its batch (committed with its position), returns and exits within milliseconds. During
    an outage it may be inside a call that does not return for a long time: a store call waits
    the connection pool's 30 s for a connection (``AGENTFOLD_PG_POOL_WAIT``), several in a
    row for a batch, or waits for ever for a server that no longer answers; a publisher's batch
    waits up to 60 s for the broker's acknowledgement. So, once ``stop`` is set:

    1. ``grace`` seconds for the command to end by itself (the batch in progress finishes);
    2. then ``interrupt()``, once: the calls it waits in fail at once
       (``EventStore.interrupt`` closes the connection pool and shuts down the sessions in
       use; ``Publisher.interrupt`` ends the wait for acknowledgements), the follow loop
       meets the failure, sees ``stop`` and returns (``retry_until_stopped``), and the
       command exits as usual, with its report and exit status;
    3. ``overrun(seconds)`` if it still has not ended ``limit`` seconds after ``stop`` was
       set (something that cannot be interrupted from another thread: a connection attempt
       in progress, a client library's own wait); for a command, ``exit_at_once``.

    ``needed``: interrupt only once it says so (asked at the end of the grace, then every
    second until the limit), for a command whose healthy shutdown may take longer than the
    grace (``serve`` lets HTTP requests finish; ``needed`` is "the store does not answer",
    ``EventStore.answers``). Without it, the interruption comes at the end of the grace.

    Interrupting loses nothing and applies nothing twice: a batch is committed with its
    tracking position in one transaction or not at all, and the next run goes on from the
    committed position (a publisher's batch that was produced but whose position was not
    stored is produced again: consumers dedupe, as after a crash). Why not exit at once on
    the signal, or shorten every wait instead: the grace lets the batch in progress commit
    in normal operation, and only an interruption ends a call that is already waiting (a
    query on a server that stopped answering waits up to ``AGENTFOLD_PG_STATEMENT_WAIT``, for
    ever with 0).

    Use it as a context manager (or ``start()`` ... ``done()``) around the following and the
    closing of what it used (a store's ``close`` waits for its pool's threads).
    """

    def __init__(
        self,
        stop: threading.Event,
        interrupt: Callable[[], None],
        *,
        grace: float = STOP_GRACE,
        limit: float = STOP_LIMIT,
        say: Callable[[str], None] | None = None,
        overrun: Callable[[float], None] | None = None,
        needed: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 <= grace <= limit:
            raise InvalidInput("stop.grace_invalid", f"the grace {grace} s must be between 0 and the limit {limit} s")
        self.stop = stop
        self.grace = grace
        self.limit = limit
        self.interrupted = False
        self._interrupt = interrupt
        self._say = say
        self._overrun = overrun
        self._needed = needed
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="agentfold-stop-guard", daemon=True)

    def start(self) -> StopGuard:
        self._thread.start()
        return self

    def done(self) -> None:
        """The command ended (and closed what it used): nothing more to bound."""
        self._done.set()

    def __enter__(self) -> StopGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.done()

    def _watch(self) -> None:
        # The signal handler only sets ``stop``; looking at it 5 times a second costs nothing.
        while not self.stop.wait(0.2):
            if self._done.is_set():
                return
        stopped = time.monotonic()

        def left() -> float:
            return max(0.0, self.limit - (time.monotonic() - stopped))

        if self._done.wait(self.grace):
            return
        while not self._done.is_set() and left() > 0:
            if self._needed is None or self._needed():
                self._interrupt_once(time.monotonic() - stopped)
                break
            self._done.wait(min(1.0, left()))  # it answers: its calls return by themselves; look again
        if self._overrun is not None and not self._done.wait(left()):
            self._overrun(time.monotonic() - stopped)

    def _interrupt_once(self, seconds: float) -> None:
        self.interrupted = True
        if self._say is not None:
            self._say(f"still busy {seconds:.0f} s after the stop: interrupting what it waits for "
                      "(uncommitted work is dropped)")
        try:
            self._interrupt()
        except Exception as exc:  # noqa: BLE001 - the limit still holds
            log.warning("interrupting failed: %s", one_line(exc))


def exit_at_once(say: Callable[[str], None], final: Callable[[], int] | None = None) -> Callable[[float], None]:
    """A command's ``StopGuard`` overrun: one line on stderr, the command's final report, then
    exit at once (``os._exit``: another thread is still inside a call that cannot be
    interrupted). Nothing is half-done: every batch was committed with its position or not at
    all, so the report of what was committed so far is the command's true report.

    ``final`` prints that report (as the command would have at its end, from what it did so
    far; nothing when it had not started) and returns the exit status (0 without it, or when
    printing it fails: the process exits anyway)."""

    def overrun(seconds: float) -> None:
        say(f"still not stopped {seconds:.0f} s after the stop: exiting now; "
            "the next run goes on from the committed position")
        status = 0
        if final is not None:
            try:
                status = final()
            except Exception as exc:  # noqa: BLE001 - exiting anyway
                say(f"no report: {one_line(exc)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    return overrun


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[threading.Event]:
    """``stop``, set by SIGTERM or SIGINT (instead of their default: the process killed
    mid-batch), so a command ends its batch and exits cleanly (``StopGuard`` bounds it).

    The signals are taken by a thread of their own (``sigtimedwait``; blocked in the calling
    thread and in the threads it starts meanwhile), not by a Python signal handler: a handler
    runs only once the main thread is back in the interpreter, which a call that waits inside
    C code (an SQLite write waiting for another process's lock, up to 30 s) would delay, and
    with it the whole bound. Enter it before starting any thread that should not take them.

    On exit the signal mask is restored, and the two signals stay noted by a handler that
    only sets ``stop``: a signal that comes while the command prints its report and exits
    must not kill it (exit 143 after a run that succeeded). Only CLI commands use this: the
    process ends right after."""
    signals = {signal.SIGTERM, signal.SIGINT}
    done = threading.Event()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def watch() -> None:
        while not done.is_set():
            if signal.sigtimedwait(signals, 0.2) is not None:
                stop.set()

    thread = threading.Thread(target=watch, name="agentfold-signals", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        done.set()
        thread.join()
        while signal.sigtimedwait(signals, 0) is not None:  # came after the thread ended
            stop.set()
        for each in signals:
            signal.signal(each, lambda number, frame: stop.set())
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
