"""CLI commands: `publish`, `transcripts`, `transcript`: the Kafka feed (docs/kafka.md).

* ``publish --bootstrap HOST:PORT --topic T [--once]`` - produce the store's events to a
  topic (after the tracked position), then follow until SIGTERM/SIGINT (or stop once
  drained with ``--once``);
* ``transcripts --bootstrap ... --topic T --group G --db URL [--once | --idle-exit S]`` -
  consume the topic in a consumer group and keep the transcript tables current;
* ``transcript PROCESS_ID --db URL`` - print one transcript.

Following (without ``--once``/``--idle-exit``), ``publish`` and ``transcripts`` outlive
store failures (the publisher also the broker's retriable ones): one line on stderr per
failure, a growing wait, then on from their durable position
(``agentfold.adapters.follower.retry_until_stopped``). SIGTERM/SIGINT end them, in every mode
(``--once`` and ``--idle-exit`` too), after the batch in progress and within
``STOP_LIMIT`` seconds, also during an outage (``agentfold.adapters.follower.StopGuard``), with
their report (also at the last resort, ``exit_at_once``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from agentfold.adapters.cli import PROG, Context, Outcome, poll_seconds, positive_seconds, print_outcome
from agentfold.adapters.eventstore import redact
from agentfold.adapters.feed import (
    DEFAULT_BATCH,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_PARTITIONS,
    DEFAULT_POLL_INTERVAL,
    HeldTree,
    Publisher,
    check_topic,
    publish_failed,
    released_line,
)
from agentfold.adapters.follower import StopGuard, exit_at_once, one_line, stop_on_signals
from agentfold.adapters.queries import corrupt_tree_error
from agentfold.adapters.transcripts import ConsumeReport, TranscriptConsumer, TranscriptStore, consume_failed
from agentfold.domain.errors import InvalidInput, NotFound


def _guard(
    stop: threading.Event, say: Callable[[str], None], interrupts: list[Callable[[], None]], final: Callable[[], int],
) -> StopGuard:
    """The bound on stopping a command: from the signal until it has closed what it used
    (``interrupts``, filled as those are opened) within ``STOP_LIMIT`` s; at the last resort
    it prints its report so far (``final``) and exits."""

    def interrupt() -> None:
        for each in interrupts:
            each()

    return StopGuard(stop, interrupt, say=say, overrun=exit_at_once(say, final))


def _say(command: str) -> Callable[[str], None]:
    """One line on stderr, for the failures a following command retries."""

    def say(line: str) -> None:
        line = " ".join(line.split())  # one line, whatever a driver's message holds (libpq's span several)
        sys.stderr.write(f"{PROG}: {command}: {line}\n")
        sys.stderr.flush()

    return say


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 1000000, not {text!r}")
    return value


def _topic(text: str) -> str:
    try:
        return check_topic(text)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def cmd_publish(ctx: Context, args: argparse.Namespace) -> Outcome:
    say = _say("publish")
    as_json = bool(getattr(args, "json", False))
    stop = threading.Event()
    interrupts: list[Callable[[], None]] = []
    publisher: Publisher | None = None
    start = 0

    announced: set[str] = set()  # following: each held tree is said once

    def on_held(held: HeldTree) -> None:
        if not args.once and held.tree_id not in announced:  # once, every held tree is reported with the output
            announced.add(held.tree_id)
            say(held.line())

    def on_released(held: HeldTree, published: int) -> None:
        announced.discard(held.tree_id)  # a later hold of the same tree is said again
        say(released_line(held, published))

    def on_still_held(held: HeldTree) -> None:
        if not args.once and held.tree_id not in announced:  # held by an earlier run: said once when following
            announced.add(held.tree_id)
            say(held.line())

    def outcome() -> Outcome:
        """The report of what it published so far (the end, or the last resort: exit_at_once)."""
        if publisher is None:  # the last resort came while it opened the store or reached the broker
            return Outcome(
                {"topic": args.topic, "events": 0, "batches": 0, "from_position": None, "position": None,
                 "failures": 0, "stopped": True},
                f"stopped before publishing anything to topic {args.topic} (it was opening the store or reaching "
                "the broker); the next run goes on from the stored position",
            )
        events, position, failures = publisher.events, publisher.position, publisher.failures
        released = publisher.released_events
        data: dict[str, Any] = {
            "topic": args.topic, "events": events, "batches": publisher.batches,
            "from_position": start, "position": position, "failures": failures,
        }
        if released:
            data["released_events"] = released
        # Records of a tree held back earlier go out when it verifies again: they are older than
        # the stored position, so they are not in the range of notification ids this run moved on.
        parts = [f"notification ids {start + 1}..{position}"] if position > start else []
        if released:
            parts.append(f"{released} record(s) of trees held back earlier, released once they verified again")
        if publisher.held_events:
            parts.append(f"{publisher.held_events} event(s) of held trees passed over")
        text = (
            f"published {events} event(s) from {redact(ctx.store_url)} to topic {args.topic}"
            + (f" ({'; '.join(parts)})" if parts else "")
            if events else
            f"nothing to publish: topic {args.topic} has every event up to notification id {position}"
            + (" but those of the held trees below" if publisher.held else "")
        ) + (f" ({failures} failure(s) retried)" if failures else "")
        if args.once and stop.is_set():  # a signal ended it, drained or not: the next run goes on from here
            data["stopped"] = True
            text += " (stopped by a signal; the next run goes on from there)"
        held = list(publisher.held.values())
        if not held:
            return Outcome(data, text)
        # Trees held back (corrupt): only then, so a healthy answer is unchanged.
        data["held_trees"] = [h.entry() for h in held]
        data["held_events"] = publisher.held_events
        text += (f"\n{len(held)} tree(s) held back (store.corrupt): their records from the position named are not on "
                 f"the topic (see {'stderr' if args.once else 'the lines above'}; `{PROG} audit verify TREE` says "
                 "what is wrong)")
        if not args.once or stop.is_set():
            # Following: reported on stderr as they were found; stopping is not a failure. A
            # signal during --once may have come before they were checked again: not a failure either.
            return Outcome(data, text)
        return Outcome(data, text, 1, problems=tuple(corrupt_tree_error(h.entry(), h.consequence()) for h in held))

    def final() -> int:
        return print_outcome(outcome(), as_json)

    # SIGTERM/SIGINT, from the start (--once too): the batch in progress ends (acknowledged,
    # position stored), then it reports and exits 0; within STOP_LIMIT s, also in an outage.
    with stop_on_signals(stop), _guard(stop, say, interrupts, final):
        store = ctx.open_store()
        try:
            interrupts.append(store.interrupt)
            publisher = Publisher(
                store, args.bootstrap, args.topic, partitions=args.partitions,
                replication_factor=args.replication_factor, batch_size=args.batch_size,
                poll_interval=args.poll_interval, connect_timeout=args.connect_timeout, on_held=on_held,
                on_released=on_released, on_still_held=on_still_held,
            )
            interrupts.append(publisher.interrupt)
            start = publisher.position
            try:
                if args.once:
                    try:
                        publisher.drain(stop)
                    except Exception as exc:
                        if not (stop.is_set() and publish_failed(exc)):
                            raise
                        # Interrupted by the guard: the batch in progress was not recorded as published.
                        say(f"stopping; the batch in progress failed: {one_line(exc)}")
                else:
                    publisher.follow_until_stopped(stop, say)
            finally:
                publisher.close()
        finally:
            store.close()
    return outcome()


def cmd_transcripts(ctx: Context, args: argparse.Namespace) -> Outcome:
    if args.once and args.idle_exit is not None:
        raise InvalidInput("cli.usage", "--once and --idle-exit are exclusive", "--once is --idle-exit 1")
    idle = 1.0 if args.once else args.idle_exit
    say = _say("transcripts")
    as_json = bool(getattr(args, "json", False))
    stop = threading.Event()
    interrupts: list[Callable[[], None]] = []
    consumer: TranscriptConsumer | None = None

    def outcome() -> Outcome:
        """The report of what it applied so far (the end, or the last resort: exit_at_once)."""
        if consumer is None:  # the last resort came while it opened the database or joined the group
            return Outcome(
                {"topic": args.topic, "group": args.group, **ConsumeReport().to_json(), "stopped": True},
                f"stopped before reading anything from {args.topic} (it was opening the database or joining "
                "the group); the next run goes on from the committed offsets",
            )
        report = consumer.report
        data = {"topic": args.topic, "group": args.group, **report.to_json()}
        t = report.totals
        text = (
            f"read {t.envelopes} envelope(s) from {args.topic} in {report.batches} batch(es): applied {t.applied}, "
            f"skipped {t.duplicates} duplicate(s), wrote {t.entries} transcript entr{'y' if t.entries == 1 else 'ies'}"
            + (f", rejected {t.rejected} invalid record(s)" if t.rejected else "")
            + (f" ({report.failures} failure(s) retried)" if report.failures else "")
        )
        return Outcome(data, text)

    def final() -> int:
        return print_outcome(outcome(), as_json)

    with stop_on_signals(stop), _guard(stop, say, interrupts, final):  # --once and --idle-exit too
        store = TranscriptStore(args.db)
        try:
            consumer = TranscriptConsumer(
                store, args.bootstrap, args.topic, args.group, group_instance_id=args.group_instance_id,
                max_records=args.max_records, connect_timeout=args.connect_timeout,
            )
            interrupts.append(consumer.interrupt)
            try:
                if idle is None:
                    consumer.follow_until_stopped(stop, say)
                else:
                    try:
                        consumer.run(stop, idle_exit=idle)
                    except Exception as exc:
                        if not (stop.is_set() and consume_failed(exc)):
                            raise
                        # Interrupted by the guard: the batch in progress was not committed.
                        say(f"stopping; the batch in progress failed: {one_line(exc)}")
            finally:
                consumer.close()
        finally:
            store.close()
    return outcome()


def cmd_transcript(ctx: Context, args: argparse.Namespace) -> Outcome:
    store = TranscriptStore(args.db, create=False)  # a reader creates nothing
    try:
        found = store.transcript(args.process_id)
    finally:
        store.close()
    if found is None:
        raise NotFound(
            "transcripts.not_found", f"no transcript of {args.process_id} in {redact(args.db)}",
            hint="only Interaction processes have transcripts; is `agentfold transcripts` running on this topic?",
        )
    return Outcome(found, transcript_text(found))


# C0 controls, DEL and C1 controls: ESC, BEL, CSI... drive a terminal (clear it, set its title,
# move the cursor); a transcript's text comes from the topic, which anyone allowed to write to it fills.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _escaped(line: str) -> str:
    """The line with every control character shown as its JSON escape (``\u001b``), as the
    commands that print JSON show it: only the layout's own line breaks reach the terminal."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def transcript_text(t: dict[str, Any]) -> str:
    """A transcript for people: one line (or two) per entry, control characters escaped (``_escaped``)."""
    lines = [f"transcript {t['process_id']}  tree {t['tree_id']}  {t['status']}  {t['entry_count']} entries"]
    if t.get("tool_call_ref"):
        lines.append(f"  delegated by tool call {t['tool_call_ref']}")
    for e in t["entries"]:
        kind = e["kind"]
        head = f"{e['seq']:>3} "
        if kind == "input_message":
            lines.append(head + f"[{e['role']}] {_short(e['text'])}")
        elif kind == "assistant_message":
            said = _short(e["text"]) if e["text"] else "(no text, only tool calls)" if e["tool_calls"] else "(no text)"
            lines.append(head + f"[assistant #{e['model_call_sequence']}] {said}")
            for call in e["tool_calls"]:
                lines.append(f"      -> {call['name']}({_short(call['arguments'], 120)})  {call['tool_call_ref']}")
        elif kind == "tool_result":
            shown = e["text"] or (_short(e["output"]) if e.get("output") is not None else e.get("status"))
            lines.append(head + f"[tool {e['tool_name']}] {e['disposition'] or e['status']}: {_short(shown)}  {e['tool_call_ref']}")
        elif kind == "input_prompt":
            lines.append(head + f"[input asked] {_short(e['prompt'])}  {e['tool_call_ref']}")
        elif kind == "input_answer":
            lines.append(head + f"[input answered] {_short(e['answer'])}")
        elif kind == "steering":
            lines.append(head + f"[steering] {_short(e['text'])}")
        elif kind == "delegate_start":
            what = f"started {e['child_process_id']}" if e["started"] else f"refused: {_short(e.get('failure'))}"
            lines.append(head + f"[delegate {e['delegate_name']}] {what}")
        elif kind == "delegate_result":
            lines.append(head + f"[delegate ended] {e['status']} {e['child_process_id']}")
        elif kind == "unknown_outcome":
            lines.append(head + f"[unknown {e['effect_kind']}] {_short(e.get('diagnostic'))}  {e['effect_id']}")
        elif kind == "unknown_resolved":
            lines.append(head + f"[resolved {e['effect_kind']}] {e['status']} by {e['resolved_by']}")
        elif kind == "feedback":
            lines.append(head + f"[feedback] {_short(e['text'])}")
        elif kind == "final_output":
            lines.append(head + f"[final] {_short(e['text'] or e['output'])}")
        elif kind == "failure":
            lines.append(head + f"[failed] {e['status']} {e.get('cause', '')} {_short(e.get('failure') or e.get('reason', ''))}")
        else:
            lines.append(head + f"[{kind}]")
    return "\n".join(_escaped(line) for line in lines)


def _connect_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connect-timeout", type=positive_seconds, default=DEFAULT_CONNECT_TIMEOUT, metavar="SECONDS",
        help="how long to wait for a first answer from --bootstrap before failing with feed.unavailable "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )


def register(command: Any) -> None:
    """Add this module's commands with ``command(name, handler, help, timeout=False)`` (agentfold.adapters.cli)."""
    publish = command(
        "publish", cmd_publish,
        "produce every event of the store to a Kafka topic (keyed by tree id), storing the position after each "
        "acknowledged batch; follows until SIGTERM unless --once",
    )
    publish.add_argument("--bootstrap", required=True, metavar="HOST:PORT", help="Kafka bootstrap servers")
    publish.add_argument("--topic", required=True, type=_topic, help="the topic (created if missing)")
    publish.add_argument("--once", action="store_true", help="publish what is stored now, then exit")
    publish.add_argument(
        "--partitions", type=_positive, default=DEFAULT_PARTITIONS, metavar="N",
        help=f"partitions of a topic this command creates (default {DEFAULT_PARTITIONS})",
    )
    publish.add_argument("--replication-factor", type=_positive, default=1, metavar="N",
                         help="replication factor of a topic this command creates (default 1)")
    publish.add_argument("--batch-size", type=_positive, default=DEFAULT_BATCH, metavar="N",
                         help=f"events per acknowledged batch (default {DEFAULT_BATCH})")
    _connect_timeout(publish)
    publish.add_argument("--poll-interval", type=poll_seconds, default=DEFAULT_POLL_INTERVAL, metavar="SECONDS",
                         help="when following: SQLite polls this often; PostgreSQL listens and re-checks every "
                         f"10 x SECONDS as a safety net (default {DEFAULT_POLL_INTERVAL})")

    transcripts = command(
        "transcripts", cmd_transcripts,
        "consume the feed in a consumer group and keep the transcript tables of --db current",
    )
    transcripts.add_argument("--bootstrap", required=True, metavar="HOST:PORT", help="Kafka bootstrap servers")
    transcripts.add_argument("--topic", required=True, type=_topic, help="the feed's topic")
    transcripts.add_argument("--group", required=True, help="the consumer group id")
    transcripts.add_argument("--db", required=True, metavar="URL", help="sqlite:///path.db or postgresql://... for the tables")
    transcripts.add_argument("--group-instance-id", metavar="ID", help="static membership (faster restarts)")
    _connect_timeout(transcripts)
    transcripts.add_argument("--max-records", type=_positive, default=1000, metavar="N",
                             help="records per batch (one database transaction each; default 1000)")
    transcripts.add_argument("--once", action="store_true", help="exit once nothing new arrived for 1 s after joining")
    transcripts.add_argument("--idle-exit", type=positive_seconds, metavar="SECONDS",
                             help="exit once nothing new arrived for this long after joining")

    transcript = command("transcript", cmd_transcript, "print the transcript of one Interaction process")
    transcript.add_argument("process_id", metavar="PROCESS_ID", help="the Interaction's process id")
    transcript.add_argument("--db", required=True, metavar="URL", help="the transcript database (as given to `transcripts`)")
