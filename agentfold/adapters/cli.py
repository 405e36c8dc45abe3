"""The ``agentfold`` command line (docs/cli.md).

Commands (every one accepts ``--json`` and ``--store URL``):

* ``trees`` - the tree index (one row per root tree);
* ``show TREE`` - one folded tree: processes, mailboxes, waits, effects, budgets;
* ``unknown`` - every unknown Effect of the live trees, waiting for a host (with its
  kind and, for a tool call, its ToolCallRef);
* ``resolve EFFECT_ID (--output JSON [--disposition D] | --model-response JSON)`` for
  Interaction effects, ``--output JSON [--status succeeded|failed]`` for others - settle
  an unknown Effect with the outcome the host established, then drive the tree until it parks;
* ``recover`` - adopt every live tree nobody owns and drive each until it parks;
* ``run SCENARIO`` - start a scenario (docs/scenarios.md) and drive it until it parks or ends;
* ``pending``, ``answer PROCESS_ID WAIT_ID JSON`` - tool input waits and their answers;
* ``steer PROCESS_ID TEXT`` - a user message for an Interaction's next model request;
* ``results TREE``, ``delegates PROCESS_ID`` - SettledResults and Delegate attributions;
* ``cancel PROCESS_ID`` - cancel a process and its subtree;
* ``project [--follow] [--rebuild]`` - keep the read-model tables current (docs/read-models.md);
* ``serve`` - the HTTP API (``agentfold/adapters/cli_serve.py``, docs/http-api.md);
* ``publish``, ``transcripts``, ``transcript`` - the Kafka feed (``agentfold/adapters/cli_feed.py``, docs/kafka.md);
* ``audit verify``, ``audit drift``, ``replay``, ``export``, ``import`` - audit tooling
  (``agentfold/adapters/cli_audit.py``, docs/audit.md);
* ``demo`` - the narrated trip-planner demo (``scripts/demo``);
* ``kernel-demo-run`` - start the kernel demo Program (``scripts/kernel-demo`` uses it).

Exit status: 0 on success, 2 when the input was refused (one line on stderr saying
why; nothing was appended), 1 for anything else (store failures, timeouts, a tree
that could not be recovered).

Programs: commands that drive a tree need the exact Program its processes run. The
CLI builds its :class:`~agentfold.adapters.catalog.Catalog` from a :class:`ProgramSources`
value: bound Programs plus loaders that rebuild a Program from the configuration a
tree stored in its ``TreeStarted``. :func:`default_sources` is what the console
script uses; another front end passes its own to :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

from eventsourcing.persistence import PersistenceError

from agentfold.adapters.eventstore import (
    NOT_FOUND_HINT,
    EventStore,
    read_only_server,
    redact,
    refuses_writes,
    sqlite_damage,
    sqlite_unwritable,
    store_url_from_env,
)
from agentfold.adapters.host import (
    answer_signal,
    checked_resolution,
    deliver_answer,
    fresh_signal_id,
    unknown_effect_tree,
)
from agentfold.adapters.interaction import steer_signal
from agentfold.adapters.kernel_demo import PROGRAM_NAME, payment_input, payment_program
from agentfold.adapters.queries import HostQueries, Listing, corrupt_tree_error
from agentfold.adapters.recorders import HeadFilter, TreeHead
from agentfold.adapters.resolution import ABSENT, settlement_for
from agentfold.adapters.runtime import CrashPlan, RandomIds, Runtime
from agentfold.adapters.scenario import load_scenario_file, scenario_input, scenario_program
from agentfold.adapters.sources import ProgramSources, default_sources
from agentfold.domain.canonical import JSON, parse_json_text
from agentfold.domain.errors import AgentfoldError, Fenced, InvalidInput, NotFound
from agentfold.domain.ids import EffectID, ProcessID, SignalID, StartID, TreeID, parse_effect_id, parse_wait_id
from agentfold.domain.kernel import replay_allowed, start_tree
from agentfold.domain.program import Program, ProgramResolver
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import CLASSIFICATIONS, STATUSES, ProcessState, Termination, TreeState
from agentfold.projections.host_views import pending_tool_inputs

PROG = "agentfold"
# Modules that add commands: each defines ``register(command)`` (see build_parser).
COMMAND_MODULES = ("agentfold.adapters.cli_serve", "agentfold.adapters.cli_audit", "agentfold.adapters.cli_feed")
DEFAULT_TIMEOUT = 60.0
# The commands that create a store that does not exist yet (docs/cli.md); every other one refuses it.
CREATING_COMMANDS = ("run", "kernel-demo-run", "import", "serve")
STORE_NOT_FOUND_HINT = (
    "pass --store or set AGENTFOLD_STORE to the store your runs use; "
    + ", ".join(f"`{c}`" for c in CREATING_COMMANDS[:-1]) + f" and `{CREATING_COMMANDS[-1]}` create a new store"
)


# ---------------------------------------------------------------------------
# Command plumbing


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a command prints: ``data`` under ``--json``, ``text`` otherwise."""

    data: JSON
    text: str
    status: int = 0
    exit_now: bool = False
    """End the process right after printing, without waiting for other threads (a server
    whose abandoned dispatcher calls are still running)."""
    problems: tuple[AgentfoldError, ...] = ()
    """Reported on stderr after the output, one line each (e.g. the trees a store-wide
    listing could not read: the output is what could be answered)."""
    body: Callable[[TextIO], None] | None = None
    """Writes the whole output (in the format asked for) in place of ``data``/``text``: a
    report too large to hold in memory (``audit verify --all``)."""


def json_text(data: JSON) -> str:
    """``data`` as every command prints it under ``--json`` (one line, keys sorted)."""
    return json.dumps(data, sort_keys=True, ensure_ascii=False, default=str)


@dataclass(frozen=True, slots=True)
class Context:
    store_url: str
    sources: ProgramSources
    timeout: float
    # The timers each tree was left waiting for when this command stopped driving it
    # (``wait_parked``): (effect id, seconds until due), reported in its summary.
    timers: dict[TreeID, list[tuple[EffectID, float]]] = field(default_factory=dict)

    def summary(self, tree: TreeState) -> dict[str, JSON]:
        """``tree_summary`` and, when this command left the tree waiting for timers, ``timers``."""
        summary = tree_summary(tree)
        timers = self.timers.get(tree.tree_id) if tree.tree_id is not None else None
        if timers and tree.classification() != "terminal":
            summary["timers"] = timers_json(timers)
        return summary

    def open_store(self, *, create: bool = False) -> EventStore:
        """Open the store. Unless ``create``, nothing is created: a missing SQLite file or a
        PostgreSQL database without agentfold's tables is refused (``store.not_found``)."""
        try:
            return EventStore(self.store_url, create=create)
        except NotFound as exc:
            if exc.hint != NOT_FOUND_HINT:  # a missing database or a partial store: its own hint
                raise
            raise NotFound(exc.code, exc.message, hint=STORE_NOT_FOUND_HINT) from None

    def runtime(self, store: EventStore, crash: CrashPlan | None = None, *extra: Program) -> Runtime:
        # poll_interval=0: no watcher thread following other writers. A command owns its
        # trees only while it drives them; input others append meanwhile makes this
        # owner's next append conflict (reload, validate again), or is taken up by the
        # next owner once the command has exited.
        catalog = self.sources.catalog()
        for program in extra:
            catalog.add(program)
        return Runtime(store, catalog, crash=crash, poll_interval=0)


Command = Callable[[Context, argparse.Namespace], Outcome]


class _UsageError(InvalidInput):
    """Bad command-line usage (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises a classified error instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError("cli.usage", message, f"see `{self.prog} --help`")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, except that arguments no parser took name the command's own help (the
        root parser reports them, and named only `agentfold --help`)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            raise _UsageError("cli.usage", f"unrecognized arguments: {' '.join(extras)}",
                              f"see `{self.prog}{' ' + command if command else ''} --help`")
        return parsed


def _wants_json(argv: Sequence[str]) -> bool:
    return "--json" in argv


def _report(exc: AgentfoldError, as_json: bool) -> None:
    if as_json:
        line = json.dumps({"error": exc.to_json()}, sort_keys=True, default=str)
    else:
        line = f"{PROG}: error: {exc}"
    sys.stderr.write(" ".join(line.split("\n")) + "\n")


def _json_text(value: JSON) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def _short(value: JSON, limit: int = 160) -> str:
    text = _json_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------
# Shared views


def timers_json(timers: list[tuple[EffectID, float]]) -> list[JSON]:
    """Waiting timers (``Runtime.waiting_timers``) as the CLI and the HTTP API list them."""
    return [{"effect_id": e, "due_in_seconds": round(left, 3)} for e, left in timers]


def tree_summary(tree: TreeState) -> dict[str, JSON]:
    """A tree's head as the CLI reports it after driving (recover, resolve, kernel-demo-run)."""
    root = tree.root
    return {
        "tree_id": tree.tree_id,
        "start_id": tree.start_id,
        "root_process_id": root.process_id,
        "program": root.program.name,
        "status": root.status,
        "classification": tree.classification(),
        "version": tree.version,
        "unknown_effect_ids": sorted(r.effect_id for p in tree.processes.values() for r in p.unknown_effects()),
    }


def _timers_text(timers: Sequence[Mapping[str, Any]]) -> str:
    first = min(t["due_in_seconds"] for t in timers)
    return (f"waiting for {len(timers)} timer(s), the first due in {first:g} s: a running `{PROG} serve`, "
            f"or `{PROG} recover` once it is due, fires it (its instant is recorded)")


def _summary_text(summary: Mapping[str, Any]) -> str:
    unknown = summary.get("unknown_effect_ids") or []
    text = (
        f"{summary['tree_id']} (start {summary['start_id']}): root {summary['status']}, "
        f"tree {summary['classification']}"
    )
    timers = summary.get("timers") or []
    if timers:
        text += "; " + _timers_text(timers)
    if unknown and summary["classification"] == "terminal":
        # The tree ended: they can no longer be resolved (they stay as evidence).
        text += f"; unresolved unknown effects (evidence, no longer resolvable): {', '.join(unknown)}"
    elif unknown:
        text += f"; unknown effects: {', '.join(unknown)}"
    return text


def _listed(data: dict[str, JSON], text: str, listing: Listing, missing: str) -> Outcome:
    """A store-wide listing's outcome: the entries of every tree that could be read and, when
    some tree's history could not be read, ``corrupt_trees`` (only then: a healthy answer is
    unchanged), one stderr line per such tree and exit status 1 (the answer is incomplete)."""
    if not listing.corrupt:
        return Outcome(data, text)
    data["corrupt_trees"] = listing.corrupt
    count = len(listing.corrupt)
    text += (f"\n\n{count} tree(s) could not be read (store.corrupt): their {missing} are missing here "
             f"(see stderr; `{PROG} audit verify TREE` says what is wrong)")
    return Outcome(data, text, 1, problems=tuple(corrupt_tree_error(e) for e in listing.corrupt))


def _fold(store: EventStore, sources: ProgramSources, tree_id: TreeID) -> tuple[TreeState, ProgramResolver | None]:
    """Fold a tree with its Programs when they can be bound, else the kernel's view."""
    return HostQueries(store, sources).fold(tree_id)


# ---------------------------------------------------------------------------
# Commands


def cmd_trees(ctx: Context, args: argparse.Namespace) -> Outcome:
    only = HeadFilter(live_only=args.live, status=args.status, classification=args.classification, last=args.last)
    store = ctx.open_store()
    try:
        heads = store.heads(only=only)
    finally:
        store.close()
    data = {"trees": [h.to_json() for h in heads]}
    if not heads:
        wanted = [w for w in ("live" if args.live else None, args.status, args.classification) if w]
        return Outcome(data, f"no {''.join(f'{w} ' for w in wanted)}trees in {redact(ctx.store_url)}")
    rows = [("TREE", "START", "PROGRAM", "STATUS", "TREE STATE", "VERSION", "UNKNOWN")]
    rows += [
        (h.tree_id, h.start_id, h.program, h.status, h.classification, str(h.version), str(len(h.unknown_effect_ids)))
        for h in heads
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)
    return Outcome(data, text)


def cmd_show(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        # A read: no runtime (which would open the store's lease file, which reads never need).
        tree_id = store.find_tree(args.tree)
        tree, _ = _fold(store, ctx.sources, tree_id)
    finally:
        store.close()
    return Outcome(tree.to_json(shown=True), _show_text(tree))


def _show_text(tree: TreeState) -> str:
    lines = [
        f"tree {tree.tree_id}  start {tree.start_id}  version {tree.version}  {tree.classification()}",
        f"writer {tree.incarnation} ({len(tree.incarnations)} incarnation(s) so far)",
    ]
    for process in tree.processes.values():
        lines.append("")
        lines.extend(_process_text(process))
    return "\n".join(lines)


def _budget_text(process: ProcessState) -> str:
    parts = []
    for name, quota in (("steps", process.budget.steps), ("effects", process.budget.effects),
                        ("signals", process.budget.signals)):
        if quota.maximum is not None:
            parts.append(f"{name} <= {quota.maximum}")
    return ", ".join(parts) if parts else "unlimited"


def _process_text(p: ProcessState) -> list[str]:
    relation = "root" if p.parent_id is None else f"child {p.child_key} of {p.parent_id} (depth {p.depth})"
    usage = p.usage
    lines = [
        f"process {p.process_id}  {p.program.name}  {p.status}",
        f"  {relation}; program {p.program}",
        f"  usage: {usage['steps']} steps, {usage['effects']} effects, {usage['signals']} signals; "
        f"budget: {_budget_text(p)}",
    ]
    pending = len(p.mailbox) - p.cursor
    lines.append(f"  mailbox: {p.arrivals} signal(s) admitted, {p.arrivals - pending} consumed, {pending} pending")
    for record in p.pending():
        lines.append(f"    pending {record.signal_id} from {record.source}: {_short(record.payload)}")
    for wait in p.waits.values():
        state = "closed" if wait.closed else ("answered" if wait.answered_by is not None else "open")
        current = " (current)" if wait.wait_id == p.current_wait else ""
        lines.append(f"  wait {wait.wait_id} key {wait.key} ({wait.kind}) {state}{current}")
    if p.pause_reason:
        lines.append(f"  paused: {p.pause_reason}")
    for kind, (owner, reason) in p.intents.items():
        lines.append(f"  pending {kind} from {owner}: {reason}")
    if p.batch:
        lines.append(f"  effects of step {p.batch_step}:")
        for r in p.batch:
            outcome = r.phase if r.status is None else f"{r.phase} {r.status.value}"
            if r.resolved_by:
                outcome += f" (resolved by {r.resolved_by})"
            lines.append(f"    #{r.index} {r.effect_id}  {r.target}  replay {r.replay}  {outcome}")
            lines.append(f"       request: {_short(r.payload)}")
            if r.status is not None and r.status.value != "unknown":
                lines.append(f"       result: {_short(r.result)}")
            if r.diagnostic is not None:
                lines.append(f"       diagnostic: {r.diagnostic}")
    if p.children:
        lines.append(f"  children: {', '.join(p.children)}")
    if p.termination is not None:
        t = p.termination
        lines.append(f"  termination: {t.status} ({t.cause}){': ' + t.reason if t.reason else ''}"
                     + (f" [{t.failure.code}]" if t.failure is not None else ""))
        if t.unresolved_effect_ids:
            lines.append(f"  unresolved effects: {', '.join(t.unresolved_effect_ids)}")
    if p.status == "completed":
        lines.append(f"  output: {_short(p.output, 400)}")
    return lines


def cmd_unknown(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        entries = HostQueries(store, ctx.sources).unknown()
    finally:
        store.close()
    data: dict[str, JSON] = {"unknown_effects": entries}
    if not entries:
        if entries.corrupt:
            return _listed(data, "no unknown effects in the trees that could be read", entries, "unknown effects")
        return Outcome(data, "no unknown effects: nothing waits for a host")
    lines: list[str] = []
    for e in entries:
        diagnostic = e["diagnostic"]
        ref = f", tool call {e['tool_call_ref']}" if e.get("tool_call_ref") else ""
        lines += [
            f"{e['effect_id']}  ({e['kind']}{ref})",
            f"  tree {e['tree_id']} (start {e['start_id']}), process {e['process_id']} ({e['program']})",
            f"  step {e['step']}, index {e['index']}, replay {e['replay']}, {e['attempts']} attempt(s)",
            f"  request: {_short(e['request'], 400)}",
        ]
        if isinstance(diagnostic, dict):
            lines.append(f"  diagnostic: {diagnostic['kind']} {diagnostic['code']}: {diagnostic['message']}")
    lines.append("")
    lines.append(
        f"resolve each with: {PROG} resolve EFFECT_ID --output JSON [--disposition D]  (tool calls), "
        "--model-response JSON (model calls), --output MESSAGES (context preparations), "
        "or --output JSON [--status S] (other effects)"
    )
    return _listed(data, "\n".join(lines), entries, "unknown effects")


def _settlement_for(
    args: argparse.Namespace, tree: TreeState, programs: ProgramResolver | None, effect_id: EffectID
) -> Settlement:
    """Build the definite settlement the host describes, with the Program's own settle helper."""
    if args.model_response == "-" and args.effective_messages == "-":
        raise _UsageError("cli.usage", "--model-response and --effective-messages cannot both read standard input",
                          "give one of them as @FILE")
    return settlement_for(
        tree, programs, effect_id,
        model_response=ABSENT if args.model_response is None
        else json_argument(args.model_response, "--model-response"),
        effective_messages=ABSENT if args.effective_messages is None
        else json_argument(args.effective_messages, "--effective-messages"),
        output=ABSENT if args.output is None else json_argument(args.output, "--output"),
        disposition=args.disposition, status=args.status,
        name=lambda member: "--" + member.replace("_", "-"),
        usage=lambda message: _UsageError("cli.usage", message),
        wrong_kind=lambda message: InvalidInput("cli.argument_invalid", message),
    )


def cmd_resolve(ctx: Context, args: argparse.Namespace) -> Outcome:
    effect_id = parse_effect_id(args.effect_id)
    store = ctx.open_store()
    try:
        tree_id = unknown_effect_tree(store, effect_id, listing_hint=f"list unknown effects with `{PROG} unknown`",
                                      where=redact(ctx.store_url))
        probe, programs = _fold(store, ctx.sources, tree_id)
        settlement = _settlement_for(args, probe, programs, effect_id)
        # Validate on a private fold first, with the kernel's own rules: a refused
        # resolution must not even make this command take ownership (WriterActivated).
        process_id = checked_resolution(probe, effect_id, settlement)
        _, tree, owned = _admit_and_drive(
            ctx, store, tree_id, lambda runtime: runtime.resolve_unknown_effect(effect_id, settlement, process_id=process_id),
            f"resolved {effect_id}")
    finally:
        store.close()
    summary = ctx.summary(tree)
    data = {
        "effect_id": effect_id,
        "process_id": process_id,
        "resolution": {"status": settlement.status.value, "payload": settlement.payload},
        "driven": owned,
        "tree": summary,
    }
    return Outcome(data, f"resolved {effect_id} as {_resolution_text(settlement)}\n" + _summary_text(summary)
                   + _owner_note(owned, tree))


#: Seconds a command that stops waiting (``--timeout``) still gives the calls in flight to
#: return, so that their outcomes are recorded rather than left unknown (``Runtime.drain``).
CALLS_GRACE = 2.0


def wait_parked(ctx: Context, runtime: Runtime, tree_id: TreeID) -> TreeState:
    """Wait until the tree parks or ends, for ``--timeout`` seconds; then stop starting calls.

    When the time is up, calls already running get ``CALLS_GRACE`` seconds to return (their
    outcomes are recorded) and no new call is started: the Effects the tree declares meanwhile
    wait, declared, for the next owner, which calls them (they are not unknown). If the tree
    parked or ended within the grace, that is the answer; otherwise TimeoutError."""
    try:
        return _wait_quiet(ctx, runtime, tree_id, ctx.timeout)
    except TimeoutError:
        pass
    return _after_drain(ctx, runtime, tree_id, runtime.drain(CALLS_GRACE))


def _wait_quiet(ctx: Context, runtime: Runtime, tree_id: TreeID, timeout: float) -> TreeState:
    """``Runtime.wait_quiet`` for at most ``timeout`` s: when the tree is left
    only waiting for timers due after that (a paused run's too), they are noted for its
    summary. Nothing is lost when the command exits: the next owner waits for the same instants."""
    tree, timers = runtime.wait_quiet(tree_id, timeout)
    ctx.timers.pop(tree_id, None)
    if timers:
        ctx.timers[tree_id] = timers
    return tree


def _after_drain(ctx: Context, runtime: Runtime, tree_id: TreeID, drained: bool) -> TreeState:
    """The tree after ``Runtime.drain`` (``drained``: nothing of the runtime's is left in
    flight); TimeoutError saying what the next owner finds when the tree is still working."""
    try:
        # Not drained (another tree's call may be what still runs): this tree is looked at as it is now.
        tree: TreeState | None = _wait_quiet(ctx, runtime, tree_id, 1.0 if drained else 0.0)
    except TimeoutError:
        if drained:
            raise
        tree = None
    if tree is not None:
        waiting = sum(1 for p in tree.live.values() for r in p.batch if r.phase == "planned")
        if tree.classification() != "progress" or (not waiting and tree_id in ctx.timers):
            return tree
        raise TimeoutError(f"tree {tree_id} was still working after {ctx.timeout:g} s; the calls under way were "
                           f"recorded and {waiting} declared effect(s) were not started (the next owner starts them)")
    running = runtime.dispatches_running() + runtime.timers_waiting()
    try:  # calls the next owner may make again (a Deadline's timer): not left unknown
        replayable = sum(1 for p in runtime.capture(tree_id).live.values() for r in p.in_flight()
                         if replay_allowed(runtime.catalog.resolve(p.program), r))
    except AgentfoldError:
        replayable = 0
    fate = "the next owner records them unknown"
    if replayable:
        fate += (f", except {replayable} whose replay policy is same_identity (e.g. a Deadline's timer), "
                 "which it makes again under the same identity")
    raise TimeoutError(f"tree {tree_id} was still working after {ctx.timeout:g} s; {running} call(s) still running "
                       f"{CALLS_GRACE:g} s later were abandoned ({fate})")


def _resolution_text(settlement: Settlement) -> str:
    """How a resolution reads: a tool call's by its disposition (the effect itself settles
    succeeded, holding the tool result the host gave: ``succeeded``, ``failed`` or ``rejected``)."""
    payload = settlement.payload
    tool = payload.get("tool_result") if isinstance(payload, dict) else None
    completion = tool.get("completion") if isinstance(tool, dict) else None
    if isinstance(completion, dict) and isinstance(completion.get("disposition"), str):
        return f"a tool result, {completion['disposition']}"
    return settlement.status.value


def _drive(ctx: Context, runtime: Runtime, tree_id: TreeID, done: str) -> TreeState:
    """Wait until the tree parks again (the command's input is already recorded)."""
    try:
        return wait_parked(ctx, runtime, tree_id)
    except (TimeoutError, AgentfoldError) as exc:
        raise AgentfoldError(
            "cli.drive_failed",
            f"{done}, but driving {tree_id} on did not finish: {exc}",
            hint=f"look with `{PROG} show {tree_id}`; `{PROG} recover` drives it on", tree_id=str(tree_id),
        ) from exc


def cmd_recover(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    entries: list[dict[str, JSON]] = []
    failed = False
    try:
        heads = store.heads(live_only=True)
        with ctx.runtime(store) as runtime:
            adopted: list[tuple[TreeHead, TreeID]] = []
            for head in heads:
                if not runtime.needs_recovery(head):
                    entries.append({**_head_summary(head), "outcome": "parked"})
                    continue
                try:
                    timers = runtime.stored_far_timers(head.tree_id, ctx.timeout)
                    if timers:
                        # Only timers due after this command's wait: adopting it would append two
                        # events and leave it again before they fire (the next owner waits for them).
                        entries.append({**_head_summary(head), "outcome": "waiting_for_timer",
                                        "timers": timers_json(timers)})
                        continue
                    handles = runtime.recover(head.tree_id, if_needed=True)
                    if not handles:  # parked meanwhile, by a `recover` racing this one
                        entries.append({**_head_summary(head), "outcome": "parked"})
                        continue
                except Fenced:
                    entries.append({**_head_summary(head), "outcome": "owned"})
                    continue
                except AgentfoldError as exc:
                    failed = True
                    entries.append({**_head_summary(head), "outcome": "error", "error": exc.to_json()})
                    continue
                adopted.extend((head, h.tree_id) for h in handles)
            # Every adopted tree runs concurrently; wait for each to park or end. The trees still
            # working when the time is up are drained together (wait_parked) and looked at again.
            late: list[tuple[TreeHead, TreeID]] = []
            for head, tree_id in adopted:
                try:
                    tree = _wait_quiet(ctx, runtime, tree_id, ctx.timeout)
                except TimeoutError:
                    late.append((head, tree_id))
                    continue
                except AgentfoldError as exc:  # this runtime stopped driving it (fenced, store failure)
                    failed = True
                    entries.append({**_head_summary(head), "outcome": "error", "error": exc.to_json()})
                    continue
                if tree_id in ctx.timers:
                    # Left waiting for a timer: while the later trees are waited for, it may
                    # fire and the run move on; looked at again after the drain, as the late ones.
                    late.append((head, tree_id))
                    continue
                entries.append({**ctx.summary(tree), "outcome": "recovered"})
            drained = runtime.drain(CALLS_GRACE) if late else True
            for head, tree_id in late:
                try:
                    tree = _after_drain(ctx, runtime, tree_id, drained)
                except (TimeoutError, AgentfoldError) as exc:
                    failed = True
                    entries.append({**_head_summary(head), "outcome": "error",
                                    "error": {"code": "cli.timeout", "message": str(exc)}})
                    continue
                entries.append({**ctx.summary(tree), "outcome": "recovered"})
    finally:
        store.close()
    order = {h.tree_id: i for i, h in enumerate(heads)}
    entries.sort(key=lambda e: order.get(str(e["tree_id"]), 0))
    data = {"trees": entries}
    if not entries:
        return Outcome(data, "no live trees to recover")
    lines = []
    for entry in entries:
        if entry["outcome"] == "recovered":
            lines.append("recovered " + _summary_text(entry))
        elif entry["outcome"] == "owned":
            lines.append(f"skipped {entry['tree_id']} (start {entry['start_id']}): another live runtime owns it")
        elif entry["outcome"] == "parked":
            lines.append(f"left {entry['tree_id']} (start {entry['start_id']}): parked, nothing in flight "
                         "(it is adopted when input reaches it)")
        elif entry["outcome"] == "waiting_for_timer":
            lines.append(f"left {entry['tree_id']} (start {entry['start_id']}): nothing to do before its timers; "
                         + _timers_text(entry["timers"]))
        else:
            error = entry["error"]
            assert isinstance(error, dict)
            lines.append(f"failed {entry['tree_id']} (start {entry['start_id']}): {error['code']}: {error['message']}")
    return Outcome(data, "\n".join(lines), 1 if failed else 0)


def _head_summary(head: TreeHead) -> dict[str, JSON]:
    return {
        "tree_id": head.tree_id,
        "start_id": head.start_id,
        "root_process_id": head.root_process_id,
        "program": head.program,
        "status": head.status,
        "classification": head.classification,
        "version": head.version,
        "unknown_effect_ids": list(head.unknown_effect_ids),
    }


def _check_start(program: Program, input: JSON, start_id: str | None, configuration: JSON) -> None:
    """Refuse what ``Runtime.start`` would refuse without the store (the start id, the input)
    before the store is opened: a refused run creates no store (exit 2: nothing created)."""
    ids = RandomIds()
    start_tree(program, input, start_id=StartID(start_id) if start_id is not None else ids.start_id(),
               root_id=ids.root_process_id(), incarnation_id=ids.incarnation_id(), configuration=configuration)


def cmd_kernel_demo_run(ctx: Context, args: argparse.Namespace) -> Outcome:
    crash = CrashPlan.parse(args.crash_after) if args.crash_after is not None else None
    if args.amount_cents < 1:
        raise InvalidInput("cli.argument_invalid", f"--amount-cents must be positive, got {args.amount_cents}")
    program = next((p for p in ctx.sources.programs if p.ref.name == PROGRAM_NAME), None) or payment_program()
    order = payment_input(args.customer, args.amount_cents, args.side_effect_log)
    _check_start(program, order, args.start_id, program.configuration)
    store = ctx.open_store(create=True)
    try:
        with ctx.runtime(store, crash) as runtime:
            handle = runtime.start(program, order, start_id=args.start_id)
            tree = wait_parked(ctx, runtime, handle.tree_id)
    finally:
        store.close()
    summary = ctx.summary(tree)
    text = "kernel demo " + _summary_text(summary)
    if tree.root.status == "completed":
        text += f"\noutput: {_short(tree.root.output, 400)}"
    return Outcome(summary, text)


def cmd_run(ctx: Context, args: argparse.Namespace) -> Outcome:
    """Start a scenario and drive it until it is terminal or parks (input wait, unknown, pause)."""
    doc = load_scenario_file(args.scenario)
    program = scenario_program(doc)
    crash = CrashPlan.parse(args.crash_after) if args.crash_after is not None else None
    _check_start(program, scenario_input(doc), args.start_id, doc)
    store = ctx.open_store(create=True)
    try:
        existed = args.start_id is not None and store.head(TreeID.for_start(StartID(args.start_id))) is not None
        with ctx.runtime(store, crash, program) as runtime:
            handle = runtime.start(program, scenario_input(doc), start_id=args.start_id, configuration=doc)
            tree = _drive(ctx, runtime, handle.tree_id, f"started {handle.tree_id}")
    finally:
        store.close()
    data = {"tree_id": tree.tree_id, "root_process_id": tree.root.process_id, "status": tree.root.status}
    summary = ctx.summary(tree)
    text = f"run {doc['name']}: " + ("this start id's run, started before: " if existed else "") + _summary_text(summary)
    pending = pending_tool_inputs(tree)
    if pending:
        text += f"\n{len(pending)} tool input(s) wait for an answer: `{PROG} pending`"
    if tree.root.status == "completed":
        text += f"\noutput: {_short(tree.root.output, 400)}"
    elif tree.root.termination is not None:
        text += f"\n{_ending(tree.root.termination)}"
    return Outcome(data, text)


def _ending(term: Termination) -> str:
    """Why a Process ended other than completed: its failure's code and message, else the reason."""
    if term.failure is not None:
        return f"{term.status}: {term.failure.code}: {term.failure.message}"
    return f"{term.status} ({term.cause}){': ' + term.reason if term.reason else ''}"


def cmd_pending(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        entries = HostQueries(store, ctx.sources).pending()
    finally:
        store.close()
    data: dict[str, JSON] = {"pending": entries}
    if not entries:
        if entries.corrupt:
            return _listed(data, "no tool waits for input in the trees that could be read", entries, "tool waits")
        return Outcome(data, "no tool waits for input")
    lines = []
    for e in entries:
        lines += [
            f"process {e['process_id']}  wait {e['wait_id']}",
            f"  tool call {e['tool_call_ref']} in tree {e['tree_id']}",
            f"  prompt: {_short(e['prompt'], 400)}",
            f"  response schema: {_short(e['response_schema'], 400)}",
        ]
    lines.append("")
    lines.append(f"answer with: {PROG} answer PROCESS_ID WAIT_ID JSON")
    return _listed(data, "\n".join(lines), entries, "tool waits")


def _signal_id(given: str | None, prefix: str) -> SignalID:
    # An empty --signal-id is an invalid id (identity.invalid), not "make one up".
    return SignalID(given) if given is not None else fresh_signal_id(prefix)


def cmd_answer(ctx: Context, args: argparse.Namespace) -> Outcome:
    process_id = ProcessID(args.process_id)
    wait_id = parse_wait_id(args.wait_id)
    response = json_argument(args.response, "the answer")
    store = ctx.open_store()
    try:
        tree_id = store.find_process_tree(process_id)
        tree, programs = _fold(store, ctx.sources, tree_id)
        signal = answer_signal(tree, programs, process_id, wait_id, response, _signal_id(args.signal_id, "answer"),
                               listing_hint=f"list pending inputs with `{PROG} pending`")
        accepted, after, driven = _admit_and_drive(
            ctx, store, tree_id, lambda runtime: deliver_answer(runtime, tree_id, process_id, signal), f"answered {wait_id}")
    finally:
        store.close()
    summary = ctx.summary(after)
    data = {"accepted": accepted, "signal_id": signal.id, "process_id": process_id, "wait_id": wait_id,
            "driven": driven, "tree": summary}
    verb = "answered" if accepted else "already answered with this signal id (nothing changed)"
    return Outcome(data, f"{verb} {wait_id}\n" + _summary_text(summary) + _owner_note(driven, after))


def cmd_steer(ctx: Context, args: argparse.Namespace) -> Outcome:
    process_id = ProcessID(args.process_id)
    signal = steer_signal(_signal_id(args.signal_id, "steer"), {"role": "user", "content": args.text})
    store = ctx.open_store()
    try:
        tree_id = store.find_process_tree(process_id)
        accepted, after, driven = _admit_and_drive(
            ctx, store, tree_id, lambda runtime: runtime.deliver_signals(process_id, [signal]), f"steered {process_id}")
    finally:
        store.close()
    summary = ctx.summary(after)
    data = {"accepted": accepted, "signal_id": signal.id, "process_id": process_id, "driven": driven, "tree": summary}
    verb = "steering queued for the next model request" if accepted else "this steering was already admitted"
    return Outcome(data, f"{verb} ({signal.id})\n" + _summary_text(summary) + _owner_note(driven, after))


def _admit_and_drive(
    ctx: Context, store: EventStore, tree_id: TreeID, admit: Callable[[Runtime], Any], done: str,
) -> tuple[Any, TreeState, bool]:
    """Admit input through a runtime of this command (which adopts the tree if nobody owns
    it), then drive the tree until it parks or ends: (what ``admit`` returned, the tree
    after, driven).
    ``driven`` is false when another live runtime owns the tree: it drives it on."""
    with ctx.runtime(store) as runtime:
        admitted = admit(runtime)
        driven = runtime.drives(tree_id)
        after = _drive(ctx, runtime, tree_id, done)
    return admitted, after, driven


def _owner_note(driven: bool, after: TreeState) -> str:
    """Said when another runtime owns the tree and has something left to drive: not of an
    ended tree (a resend to a finished run named an owner that did not exist), nor of a
    parked one (its lease may have been held only for a moment; nothing is to drive)."""
    if driven or after.classification() != "progress":
        return ""
    return "\n(another runtime owns this tree and drives it on)"


def cmd_cancel(ctx: Context, args: argparse.Namespace) -> Outcome:
    process_id = ProcessID(args.process_id)
    store = ctx.open_store()
    try:
        tree_id = store.find_process_tree(process_id)
        recorded, after, driven = _admit_and_drive(
            ctx, store, tree_id, lambda runtime: runtime.cancel(process_id, args.reason), f"canceled {process_id}")
    finally:
        store.close()
    summary = ctx.summary(after)
    data = {"recorded": recorded, "process_id": process_id, "driven": driven, "tree": summary}
    return Outcome(data, ("cancellation recorded" if recorded else "already canceling") + "\n"
                   + _summary_text(summary) + _owner_note(driven, after))


def cmd_pause(ctx: Context, args: argparse.Namespace) -> Outcome:
    return _pause_or_resume(ctx, args, "pause")


def cmd_resume(ctx: Context, args: argparse.Namespace) -> Outcome:
    return _pause_or_resume(ctx, args, "resume")


def _pause_or_resume(ctx: Context, args: argparse.Namespace, control: str) -> Outcome:
    process_id = ProcessID(args.process_id)
    store = ctx.open_store()
    try:
        tree_id = store.find_process_tree(process_id)

        def admit(runtime: Runtime) -> bool:
            return runtime.pause(process_id, args.reason) if control == "pause" else runtime.resume(process_id)

        recorded, after, driven = _admit_and_drive(ctx, store, tree_id, admit, f"{control}d {process_id}")
    finally:
        store.close()
    summary = ctx.summary(after)
    data = {"recorded": recorded, "process_id": process_id, "driven": driven, "tree": summary}
    said = {("pause", True): "pause recorded", ("pause", False): "already paused",
            ("resume", True): "resume recorded"}.get((control, recorded), "nothing changed")
    return Outcome(data, said + "\n" + _summary_text(summary) + _owner_note(driven, after))


def cmd_results(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        queries = HostQueries(store, ctx.sources)
        data = queries.results(queries.tree_of(args.tree))
    finally:
        store.close()
    rounds = data["rounds"]
    if not rounds:
        return Outcome(data, "no open round has settled results")
    lines = []
    for r in rounds:
        lines.append(
            f"process {r['process_id']} model call {r['model_call_sequence']}: {len(r['entries'])} of "
            f"{r['call_count']} result(s){' (complete)' if r['complete'] else ''}  {r['digest']}"
        )
        for e in r["entries"]:
            lines.append(f"  #{e['tool_call_index']} {e['call']['name']} {e['disposition']}: {_short(e['result']['output'], 200)}")
    return Outcome(data, "\n".join(lines))


def cmd_gates(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        queries = HostQueries(store, ctx.sources)
        if args.tree is not None:
            gates = queries.gates(queries.tree_of(args.tree))
        else:
            listing = queries.gates()
    finally:
        store.close()
    if args.tree is not None:
        if not gates:
            return Outcome({"gates": gates}, "no InputGate waits for an answer")
        lines = [f"{g['process_id']} {g['wait_id']}  task {g['task']}: {_short(g['request'], 200)}" for g in gates]
        return Outcome({"gates": gates}, "\n".join(lines))
    data: dict[str, JSON] = {"gates": listing}
    if not listing:
        if listing.corrupt:
            return _listed(data, "no InputGate waits for an answer in the trees that could be read", listing, "gates")
        return Outcome(data, "no InputGate waits for an answer")
    lines = [f"{g['tree_id']} {g['process_id']} {g['wait_id']}  task {g['task']}: {_short(g['request'], 200)}"
             for g in listing]
    return _listed(data, "\n".join(lines), listing, "gates")


def cmd_delegates(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = ctx.open_store()
    try:
        queries = HostQueries(store, ctx.sources)
        data = queries.delegates(args.process_id)
        statuses = {}
        if data["delegates"]:
            run = queries.run(queries.tree_of_process(args.process_id))
            statuses = {p["process_id"]: p["status"] for p in run["processes"]}
    finally:
        store.close()
    if not data["found"]:
        return Outcome(data, f"process {args.process_id} is not an Interaction")
    if not data["delegates"]:
        return Outcome(data, "no delegated calls")
    lines = [
        f"{a['tool_call_ref']}  {a['tool_call']['name']}({a['tool_call']['arguments']}) -> {a['child_process_id']} "
        f"[{statuses.get(a['child_process_id'], '?')}]"
        for a in data["delegates"]
    ]
    return Outcome(data, "\n".join(lines))


#: Seconds between the progress lines of a long store-wide command (``audit verify``, the
#: catch-up of ``project``), on stderr: stdout keeps the report.
PROGRESS_EVERY = 5.0


class Ticker:
    """Says when a long command's next progress line is due (every ``PROGRESS_EVERY`` s)."""

    def __init__(self) -> None:
        self.started = self.said = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.said < PROGRESS_EVERY:
            return False
        self.said = now
        return True

    def rate(self, count: int) -> float:
        """``count`` per second since the command began."""
        elapsed = time.monotonic() - self.started
        return count / elapsed if elapsed > 0 else 0.0


def cmd_project(ctx: Context, args: argparse.Namespace) -> Outcome:
    """Bring the read models up to date (once, or following), or rebuild them from zero."""
    from agentfold.adapters.follower import (
        BatchReport,
        Follower,
        FollowProgress,
        StopGuard,
        corrupt_tree_line,
        exit_at_once,
        follow_until_stopped,
        one_line,
        stop_on_signals,
        store_failed,
    )
    from agentfold.adapters.read_models import CorruptTree

    def say(line: str) -> None:
        sys.stderr.write(f"{PROG}: project: {line}\n")
        sys.stderr.flush()

    # Trees found corrupt: skipped and recorded with their batch (docs/read-models.md).
    # Following, each is reported on stderr as soon as its batch commits; once, they are
    # reported with the output (exit 1: newly found damage).
    found: list[CorruptTree] = []

    def on_corrupt(tree: CorruptTree) -> None:
        found.append(tree)
        if args.follow:
            say(corrupt_tree_line(tree))

    as_json = bool(getattr(args, "json", False))
    # SIGTERM/SIGINT, from the start (the first catch-up too, with or without --follow): the
    # batch in progress ends (committed with its position), then the command reports and
    # exits 0; within STOP_LIMIT s, also during an outage (StopGuard).
    stop = threading.Event()
    stores: list[EventStore] = []
    started = time.perf_counter()
    follower: Follower | None = None
    caught_up_in: float | None = None  # seconds of the first catch-up (or rebuild)
    progress: FollowProgress | None = None  # once following

    def outcome() -> Outcome:
        """The report of what it did so far (the end, or the last resort: exit_at_once)."""
        seconds = time.perf_counter() - started if caught_up_in is None else caught_up_in
        if follower is None:  # the last resort came while it opened the store
            return Outcome(
                {"rebuilt": bool(args.rebuild), "events": 0, "position": None, "seconds": round(seconds, 3),
                 "stopped": True},
                "stopped before projecting anything (it was opening the store); the next run goes on from the "
                "read models' position",
            )
        data: dict[str, JSON] = {"rebuilt": bool(args.rebuild), "events": follower.events_applied,
                                 "position": follower.position, "seconds": round(seconds, 3)}
        if args.follow:  # stopped (following, or before it followed: its catch-up is part of it)
            report = progress.report() if progress is not None else FollowProgress(follower).report()
            data.update(events=report.events, position=report.position, failures=report.failures)
            text = f"stopped at position {report.position} after {report.events} event(s)" + (
                f" ({report.failures} store failure(s) retried)" if report.failures else "")
        else:
            text = (f"{'rebuilt' if args.rebuild else 'projected'} {follower.events_applied} event(s) in "
                    f"{seconds:.2f} s; read models at position {follower.position}")
            if stop.is_set():  # a signal ended it, caught up or not: the next run goes on from here
                data["stopped"] = True
                text += " (stopped by a signal; the next run goes on from there)"
        if not found:
            return Outcome(data, text)
        data["corrupt_trees"] = [tree.entry() for tree in found]
        text += (f"\n{len(found)} corrupt tree(s) found and skipped: the read models hold no rows of them "
                 f"(`{PROG} audit verify TREE` says what is wrong)")
        if args.follow:
            return Outcome(data, text)  # reported on stderr as they were found; stopping is not a failure
        consequence = "the read models skip it (no rows of it) and went on with every other tree"
        return Outcome(data, text, 1, problems=tuple(corrupt_tree_error(tree.entry(), consequence) for tree in found))

    def final() -> int:
        return print_outcome(outcome(), as_json)

    def interrupt() -> None:
        for store in stores:
            store.interrupt()

    guard = StopGuard(stop, interrupt, say=say, overrun=exit_at_once(say, final))
    with stop_on_signals(stop), guard:  # the guard bounds the stop until the store is closed
        store = ctx.open_store()
        stores.append(store)
        try:
            def make() -> Follower:
                return Follower(store, ctx.sources.catalog(), batch_size=args.batch,
                                poll_interval=args.poll_interval, on_corrupt=on_corrupt, on_unbound=say)

            follower = make()
            ticker = Ticker()

            def on_batch(report: BatchReport) -> None:
                # A catch-up of a large store takes minutes: say how far it is (on stderr).
                if not ticker.due():
                    return
                head = store.max_notification_id()
                if report.position < head:  # none once caught up: the report follows
                    events = follower.events_applied if follower is not None else 0
                    say(f"at position {report.position:,} of {head:,} ({events:,} events by this run, "
                        f"{ticker.rate(events):,.0f} events/s)")

            try:
                if args.rebuild:
                    follower.rebuild(stop, on_batch)
                else:
                    follower.catch_up(stop, on_batch)
            except Exception as exc:
                if not (stop.is_set() and store_failed(exc)):
                    raise
                # Interrupted by the guard: the batch in progress was not committed.
                say(f"stopping; the batch in progress failed: {one_line(exc)}")
            caught_up_in = time.perf_counter() - started
            if args.follow:
                if not as_json and not stop.is_set():
                    sys.stdout.write(
                        f"{'rebuilt' if args.rebuild else 'projected'} {follower.events_applied} event(s) in "
                        f"{caught_up_in:.2f} s; read models at position {follower.position}\n"
                        "following (Ctrl-C to stop)\n"
                    )
                    sys.stdout.flush()
                # Store failures while following (a server restart, terminated sessions) are
                # reported on stderr and retried from the committed tracking position.
                progress = FollowProgress(follower)
                follow_until_stopped(make, stop, say, first=follower, progress=progress)
        finally:
            store.close()
    return outcome()


def cmd_demo(ctx: Context, args: argparse.Namespace) -> Outcome:
    from agentfold.adapters.demo import DemoFailed, run_demo

    as_json = bool(getattr(args, "json", False))
    try:
        observed = run_demo(say=(lambda line: None) if as_json else print)
    except DemoFailed as exc:
        raise AgentfoldError("demo.failed", str(exc)) from exc
    return Outcome(observed, "demo finished: the run completed and the hotel was booked exactly once")


# ---------------------------------------------------------------------------
# Parser and entry point


#: The longest ``--timeout`` a command accepts (30 days): beyond, waits overflow the platform's clock.
MAX_TIMEOUT = 30 * 86400.0


def _seconds(text: str) -> float:
    """A ``--timeout``: a finite number of seconds from 0 to ``MAX_TIMEOUT``, refused before
    anything is appended (a bad value found after the input was admitted left a call unknown)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_TIMEOUT:  # also NaN
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds from 0 to {MAX_TIMEOUT:.0f}")
    return value


def json_argument(text: str, what: str) -> JSON:
    """A JSON argument, parsed and normalized: given as text, or read from a file (``@PATH``)
    or standard input (``-``), since a command line holds at most 128 KiB per argument on
    Linux, below the payload limits. Neither form is valid JSON text itself: no ambiguity."""
    raw: str | bytes = text
    if text == "-":
        raw = sys.stdin.buffer.read()
    elif text.startswith("@"):
        path = text[1:]
        if not path:
            raise InvalidInput("cli.argument_invalid", f"{what}: '@' names no file",
                               hint="@PATH reads the JSON from a file, - from standard input")
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidInput("cli.argument_invalid", f"{what}: cannot read {path}: {exc.strerror or exc}",
                               hint="@PATH reads the JSON from a file, - from standard input") from exc
    return parse_json_text(raw, what=what)


#: The largest count an option takes (a --batch beyond it only overflows the database's integers).
MAX_COUNT = 1_000_000


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is not from 1 to {MAX_COUNT}")
    return value


#: The shortest ``--poll-interval`` of a follower: below a millisecond it only keeps a core busy
#: polling (``1e-300`` spun at ~45% of a core on an idle SQLite store).
MIN_POLL_INTERVAL = 0.001


def positive_seconds(text: str) -> float:
    """An option's number of seconds: positive and at most ``MAX_TIMEOUT`` (``--idle-exit``;
    beyond, a wait overflowed the platform's clock: ``cli.internal`` once the command ran)."""
    return _seconds_within(text, 0.0, "a positive number of seconds")


def poll_seconds(text: str) -> float:
    """A follower's ``--poll-interval``: from ``MIN_POLL_INTERVAL`` to ``MAX_TIMEOUT`` seconds."""
    return _seconds_within(text, MIN_POLL_INTERVAL, f"a number of seconds from {MIN_POLL_INTERVAL:g}")


def _seconds_within(text: str, least: float, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 0 and least <= value <= MAX_TIMEOUT):  # NaN compares false
        raise argparse.ArgumentTypeError(f"must be {what} up to {MAX_TIMEOUT:.0f} (30 days), not {text!r}")
    return value


def _installed_version() -> str:
    """The version of the installed ``agentfold`` distribution (``unknown (not installed)`` when
    run from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentfold")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked (importlib.metadata costs every
    other command line milliseconds of start-up)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(f"{PROG} {_installed_version()}\n")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--store", metavar="URL", default=argparse.SUPPRESS,
        help="event store URL: sqlite:///path.db, postgresql://user:pass@host:port/db or memory: "
        "(default: $AGENTFOLD_STORE, else sqlite:///./agentfold.db)",
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON (docs/cli.md)")
    parser = _Parser(
        prog=PROG, parents=[common],
        description="Operate agentfold process trees: list, inspect, recover, and settle unknown effects.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print the installed version of agentfold and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    def command(name: str, fn: Command, help: str, timeout: bool = False) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], help=help, description=help)
        sub.set_defaults(handler=fn)
        if timeout:
            sub.add_argument(
                "--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                help=f"how long to wait for a tree to park, 0 to {MAX_TIMEOUT:.0f} (default {DEFAULT_TIMEOUT:g})",
            )
        return sub

    trees = command("trees", cmd_trees, "list the trees in the store (the tree index)")
    trees.add_argument("--live", action="store_true", help="only trees that are not terminal")
    trees.add_argument("--status", choices=STATUSES, help="only trees whose root Process has this status")
    trees.add_argument("--classification", choices=CLASSIFICATIONS,
                       help="only trees in this state")
    trees.add_argument("--last", type=_positive_int, metavar="N",
                       help="only the N most recently started of those trees (still listed oldest first)")
    show = command("show", cmd_show, "show one folded tree: processes, mailboxes, waits, effects, budgets")
    show.add_argument("tree", metavar="TREE", help="a tree id (tree:...), a start id or a process id")
    command("unknown", cmd_unknown, "list every unknown effect of the live trees")
    resolve = command(
        "resolve", cmd_resolve, "settle an unknown effect with a definite outcome, then drive its tree", timeout=True
    )
    resolve.add_argument("effect_id", metavar="EFFECT_ID", help="an effect id listed by `agentfold unknown`")
    resolve.add_argument(
        "--output", metavar="JSON", default=None,
        help="the outcome (JSON text, @FILE or - for standard input): a tool call's output (text or "
        "{content, details}), or another effect's payload",
    )
    resolve.add_argument(
        "--disposition", choices=("succeeded", "failed", "rejected"), default=None,
        help="a tool call's disposition (default succeeded)",
    )
    resolve.add_argument("--model-response", metavar="JSON", default=None,
                         help="a model call's response (JSON text, @FILE or - for standard input)")
    resolve.add_argument("--effective-messages", metavar="JSON", default=None,
                         help="with --model-response, for a program that reduces its context: the messages the "
                              "model received (a JSON list, @FILE or -)")
    resolve.add_argument(
        "--status", choices=("succeeded", "failed"), default=None,
        help="the outcome of an effect that is neither a tool nor a model call (default succeeded)",
    )
    command("recover", cmd_recover, "adopt every live tree nobody owns and drive each until it parks", timeout=True)
    demo = command(
        "kernel-demo-run", cmd_kernel_demo_run,
        "start the kernel demo program demo.payment and drive it until it parks (used by scripts/kernel-demo)", timeout=True,
    )
    demo.add_argument("--side-effect-log", required=True, metavar="PATH",
                      help="file the demo's charge and receipt append to (stands in for the outside world)")
    demo.add_argument("--start-id", metavar="ID", default=None, help="idempotent start id (default: a fresh one)")
    demo.add_argument("--customer", default="ada", help="customer name (default ada)")
    demo.add_argument("--amount-cents", type=int, default=1250, help="amount to charge (default 1250)")
    demo.add_argument(
        "--crash-after", metavar="POINT", default=None,
        help="end the process with exit status 75 at POINT: declared:N, dispatched:N, in-dispatch:N, settled:N, "
        "after:<Event>:N or before:<Event>:N (docs/cli.md)",
    )
    run = command("run", cmd_run, "start a scenario and drive it until it ends or parks", timeout=True)
    run.add_argument("scenario", metavar="SCENARIO", help="a scenario file (docs/scenarios.md)")
    run.add_argument("--start-id", metavar="ID", default=None, help="idempotent start id (default: a fresh one)")
    run.add_argument(
        "--crash-after", metavar="POINT", default=None,
        help="end the process with exit status 75 at POINT: declared:N, dispatched:N, in-dispatch:N, settled:N, "
        "after:<Event>:N or before:<Event>:N (docs/cli.md)",
    )
    command("pending", cmd_pending, "list tool calls that wait for a human answer")
    answer = command("answer", cmd_answer, "answer a pending tool input (or an InputGate's wait), then drive the run on",
                     timeout=True)
    answer.add_argument("process_id", metavar="PROCESS_ID",
                        help="the Tool child process (from `pending`), or an InputGate process (docs/team.md)")
    answer.add_argument("wait_id", metavar="WAIT_ID", help="its current wait (from `pending`)")
    answer.add_argument("response", metavar="JSON",
                        help="the answer (JSON text, @FILE or - for standard input); it must satisfy the wait's "
                        "response schema")
    answer.add_argument("--signal-id", metavar="ID", default=None, help="deduplication id (resend it to retry safely)")
    steer = command("steer", cmd_steer, "add a user message to the next model request of an Interaction", timeout=True)
    steer.add_argument("process_id", metavar="PROCESS_ID", help="the Interaction process")
    steer.add_argument("text", metavar="TEXT", help="the steering message")
    steer.add_argument("--signal-id", metavar="ID", default=None, help="deduplication id (resend it to retry safely)")
    results = command("results", cmd_results, "the settled tool results of each open round (SettledResults)")
    results.add_argument("tree", metavar="TREE", help="a tree id, a start id or a process id")
    gates = command("gates", cmd_gates, "the InputGates that wait for an answer, of one run or of every run (docs/team.md)")
    gates.add_argument("tree", metavar="TREE", nargs="?", default=None,
                       help="a tree id, a start id or a process id (none: every run)")
    delegates = command("delegates", cmd_delegates, "which child process each delegated tool call started")
    delegates.add_argument("process_id", metavar="PROCESS_ID", help="the Interaction process")
    cancel = command("cancel", cmd_cancel, "cancel a process and its subtree, then drive the tree on", timeout=True)
    cancel.add_argument("process_id", metavar="PROCESS_ID", help="the process to cancel")
    cancel.add_argument("--reason", default="canceled by host", help="why (recorded with the cancellation)")
    pause = command("pause", cmd_pause, "pause a process (it takes no Step until resumed); its calls under way finish",
                    timeout=True)
    pause.add_argument("process_id", metavar="PROCESS_ID", help="the process to pause")
    pause.add_argument("--reason", default="paused by host", help="why (recorded with the pause)")
    resume = command("resume", cmd_resume, "resume a paused process, then drive the tree on", timeout=True)
    resume.add_argument("process_id", metavar="PROCESS_ID", help="the paused process")
    project = command(
        "project", cmd_project,
        "bring the read-model tables up to date with the event store (docs/read-models.md)",
    )
    project.add_argument("--follow", action="store_true", help="keep following new events until interrupted")
    project.add_argument("--rebuild", action="store_true", help="empty the tables and project every event again")
    project.add_argument("--batch", type=_positive_int, default=1000, metavar="N",
                         help="events per transaction (default 1000)")
    project.add_argument("--poll-interval", type=poll_seconds, default=0.05, metavar="SECONDS",
                         help="with --follow: SQLite polls this often; PostgreSQL listens and re-checks every "
                         "10 x SECONDS as a safety net (default 0.05)")
    for module in COMMAND_MODULES:  # commands kept in their own modules (each has register(command))
        importlib.import_module(module).register(command)
    # No --timeout: each step of the demo is its own `agentfold` process with its own bound.
    command("demo", cmd_demo, "run the bundled trip-planner scenario through a crash, a recovery and a human answer "
            "(on its own temporary SQLite store; --store is ignored)")
    return parser


def main(argv: Sequence[str] | None = None, *, sources: ProgramSources | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 2 refused input, 1 otherwise)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(args_list)
    for index, arg in enumerate(args_list, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            # Python hands bytes that are not UTF-8 over as lone surrogates, which no id,
            # payload or reason may hold (they failed deep inside, as cli.internal).
            _report(_UsageError("cli.argument_invalid",
                                f"argument {index} ({ascii(arg)[:80]}) is not valid UTF-8 text",
                                "pass UTF-8 text; read JSON from a file with @PATH"), as_json)
            return 2
    try:
        args = build_parser().parse_args(args_list)
    except _UsageError as exc:
        _report(exc, as_json)
        return exc.exit_status
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    as_json = bool(getattr(args, "json", False))
    store_url = ""
    try:
        ctx = Context(
            # demo makes its own temporary store: a wrong --store or AGENTFOLD_STORE is no concern of it
            store_url="" if args.handler is cmd_demo else store_url_from_env(getattr(args, "store", None)),
            sources=sources or default_sources(),
            timeout=float(getattr(args, "timeout", DEFAULT_TIMEOUT)),
        )
        store_url = ctx.store_url
        outcome: Outcome = args.handler(ctx, args)
    except AgentfoldError as exc:
        _report(exc, as_json)
        return exc.exit_status
    except TimeoutError as exc:
        _report(AgentfoldError("cli.timeout", str(exc) or "timed out", "raise --timeout or look with `show`"), as_json)
        return 1
    except KeyboardInterrupt:
        _report(AgentfoldError("cli.interrupted", "interrupted",
                               "input already admitted is kept; `agentfold recover` drives the tree on"), as_json)
        return 130
    except (PersistenceError, sqlite3.Error) as exc:
        # A store failure no layer below classified (a read-only file when tables must be made,
        # a damaged SQLite file, a PostgreSQL standby).
        if refuses_writes(exc):
            _report(read_only_server("the store refused a write"), as_json)
            return 1
        _report(sqlite_damage(exc, store_url) or sqlite_unwritable(exc, "the store refused a write") or AgentfoldError(
            "store.unavailable", f"the store failed: {type(exc).__name__}: {exc}",
            "check that the store is reachable and writable"), as_json)
        return 1
    except BrokenPipeError:
        raise  # the reader of stdout went away while the command printed: ``entry`` exits 141
    except Exception as exc:  # noqa: BLE001 - the CLI reports every failure as one line
        if refuses_writes(exc):  # e.g. the transcript consumer's own PostgreSQL database
            _report(read_only_server("the database refused a write"), as_json)
            return 1
        _report(AgentfoldError("cli.internal", f"{type(exc).__name__}: {exc}"), as_json)
        return 1
    status = print_outcome(outcome, as_json)
    if outcome.exit_now:
        sys.stderr.flush()
        os._exit(status)
    return status


def print_outcome(outcome: Outcome, as_json: bool) -> int:
    """Print what a command answers (stdout; its problems on stderr); returns its exit status.
    Also for a command's report at the last resort (``agentfold.adapters.follower.exit_at_once``)."""
    if outcome.body is not None:
        outcome.body(sys.stdout)
    elif as_json:
        sys.stdout.write(json_text(outcome.data) + "\n")
    else:
        sys.stdout.write(outcome.text + "\n")
    sys.stdout.flush()
    for problem in outcome.problems:
        _report(problem, as_json)
    sys.stderr.flush()
    return outcome.status


def _buffer_stdout() -> None:
    """Give standard output a buffered layer when Python runs unbuffered (``PYTHONUNBUFFERED``,
    ``-u``: common in containers). Its unbuffered text layer drops what a short write to a
    pipe did not take, so a reader that went away (``agentfold show --json | head``) cut the
    output silently and the command exited 0, not 141; a buffered writer writes every byte or
    raises ``BrokenPipeError``. Lines still go out as they are printed (line buffering)."""
    out = sys.stdout
    if isinstance(out, io.TextIOWrapper) and isinstance(out.buffer, io.RawIOBase):
        out.flush()
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(out.buffer), encoding=out.encoding, errors=out.errors,
                                      line_buffering=True)


def _reader_gone() -> int:
    """The reader of stdout went away (`agentfold ... | head`): stop quietly, as a command killed
    by SIGPIPE would (exit 141), without Python's traceback or its second error at exit (what
    stdout still holds goes to /dev/null)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _output_failed(exc: OSError) -> int:
    """Writing the answer to standard output failed (a full disk behind ``> FILE``): one
    classified line on stderr, exit 1, instead of Python's traceback and exit 120 (what stdout
    still holds goes to /dev/null). A file written that way lacks the end of the answer (an
    export its end line: import refuses it)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    _report(AgentfoldError(
        "cli.output_failed", f"writing the answer to standard output failed: {exc.strerror or exc}; "
        "what was written is incomplete",
        hint="free space where standard output goes and run the command again (export also writes to a file: "
        "--out FILE)",
    ), _wants_json(sys.argv[1:]))
    return 1


def entry(sources: ProgramSources | None = None) -> None:
    """The ``agentfold`` console script: ``main``, then exit without waiting for calls it abandoned.
    A deployment's own console script calls it with its ``sources`` (docs/python.md).

    A tool or model call still running when a command stops waiting (``--timeout``, Ctrl-C)
    is abandoned with the command (docs/cli.md): whoever drives the tree next records it
    unknown. Python would wait at exit for the thread running it, i.e. for the call to return:
    a hung tool kept the command alive, long after it had reported.
    """
    _buffer_stdout()
    try:
        status = main(sources=sources)
    except KeyboardInterrupt:
        status = 130
    except BrokenPipeError:
        status = _reader_gone()
    except OSError as exc:
        status = _output_failed(exc)
    # The command has answered; the process only exits now. Python resets its own signal
    # handlers to the default while it finalizes, so a SIGTERM in that instant (an operator
    # or a scheduler stopping a job that just finished) killed it: exit 143 after a success.
    # Ignored signals stay ignored through finalization.
    for each in (signal.SIGTERM, signal.SIGINT):
        signal.signal(each, signal.SIG_IGN)
    try:
        sys.stdout.flush()  # what is left of a buffered answer
    except BrokenPipeError:
        status = _reader_gone()
    except OSError as exc:
        status = _output_failed(exc)
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
