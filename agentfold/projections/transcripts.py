"""Product transcripts: per Interaction Process, the ordered conversation, built from feed envelopes.

A pure function of the feed's envelopes (docs/kafka.md): no I/O, no Programs, no fold.
A consumer in any language can do the same from the topic alone, so this module only
reads what the envelopes carry (the stored event bodies) and never asks the store.

One :class:`TreeTranscripts` per root tree takes that tree's envelopes in position
order (the feed keys every event by tree id, so a partition keeps them in order),
skips duplicates (a position it already applied: the feed is at least once), refuses
a gap (:class:`TranscriptGap`), and returns the new entries each envelope makes. Its
whole state is JSON (:meth:`TreeTranscripts.to_json`), so a consumer can store it next
to the entries in one transaction and resume exactly where it stopped.

Which Processes get a transcript: a Process becomes an Interaction when it declares
its first model call (or context preparation). Its transcript then starts with the
messages of its input, and goes on with, in the order the events were stored:

``input_message``     one per input message (system, user, ...)
``assistant_message`` a model response, with its tool calls (each with its ToolCallRef)
``tool_result``       the model-visible result of one tool call (ToolCallRef, disposition)
``input_prompt``      a tool asked a human (the Tool child's wait, prompt, response schema)
``input_answer``      the human's answer to that prompt
``steering``          a steering message admitted for the next model request
``delegate_start``    a Delegate call started a child (or its start was refused)
``delegate_result``   that child ended (status, output or failure)
``unknown_outcome``   a model, context or tool call whose outcome is unknown
``unknown_resolved``  a host (or a replay) settled it
``feedback``          a completion validator's feedback, sent to the model as a user message
``final_output``      the Interaction completed (its output)
``failure``           the Interaction ended otherwise (status, cause, failure)

Every entry has ``process_id`` (the Interaction), ``seq`` (1, 2, ... within the
transcript), ``kind``, and the ``notification_id``, ``position`` and ``timestamp`` of
the event that made it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

from agentfold.domain.errors import AgentfoldError
from agentfold.domain.ids import EffectID, wait_id_for
from agentfold.domain.input_changes import INPUT_PATCH, apply_changes, holds_input_patch
from agentfold.domain.interaction.refs import DELEGATE_CHILD_PREFIX, TOOL_CHILD_PREFIX, delegate_child_key

Entry = dict[str, Any]
Envelope = Mapping[str, Any]

SCHEMA_VERSION = 1
#: The newest schema version this builder knows per event type (others: 1). Version 2 of
#: ``ProcessTerminated`` may carry ``output_of`` instead of ``output``; version 2 of
#: ``EffectDeclared`` a child start's ``input_patch`` instead of its ``input`` (docs/events.md),
#: rebuilt from the last input of the same Program the parent started (``_rebuilt_input``).
SCHEMA_VERSIONS: dict[str, int] = {"ProcessTerminated": 2, "EffectDeclared": 2}
#: Succeeded settlements kept per live Tool or Delegate child, to resolve ``output_of``.
SETTLED_KEPT = 4


#: The members of a child's input the builder reads: an Interaction's ``messages``, a Tool
#: child's ``call``. Only these are kept to rebuild a later input stored as changes (a team's
#: Turns, which have neither, are not kept whole in the builder's saved state).
READ_MEMBERS = ("messages", "call")


def _read_members(value: Any) -> Any:
    return {k: value[k] for k in READ_MEMBERS if k in value} if isinstance(value, dict) else None


def supported_version(type_name: Any, version: Any) -> bool:
    return isinstance(version, int) and 1 <= version <= SCHEMA_VERSIONS.get(str(type_name), 1)
ENVELOPE_MEMBERS = (
    "notification_id", "tree_id", "position", "process_id", "type", "schema_version", "timestamp", "payload", "digest",
)
EVENT_TYPES = (
    "TreeStarted", "WriterActivated", "ProcessStarted", "SignalAdmitted", "StepCommitted", "EffectDeclared",
    "EffectDispatched", "EffectSettled", "EffectResolved", "CheckpointCommitted", "ControlRequested",
    "ProcessTerminated",
)
ENTRY_KINDS = (
    "input_message", "assistant_message", "tool_result", "input_prompt", "input_answer", "steering",
    "delegate_start", "delegate_result", "unknown_outcome", "unknown_resolved", "feedback", "final_output", "failure",
)
TOOL_INPUT_WAIT_KEY = "interaction.tool_input"
# The documented envelope schema's patterns (docs/kafka.md, "The envelope": each is the schema's
# ``pattern`` between its ``^`` and ``$``; tests/feed checks that they are the same), matched
# with ``fullmatch``: Python's ``$`` would also take a trailing line break, the schema's does not.
# A digest is exactly the chained SHA-256 (the consumer recomputes it), a tree id exactly the
# store's, a timestamp the append's UTC time, a process id the store's.
DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")
TREE_ID_PATTERN = re.compile(r"tree:[0-9a-f]{32}")
PROCESS_ID_PATTERN = re.compile(r"process:[0-9a-f]+")
TIMESTAMP_PATTERN = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?Z")
#: Each string member of the envelope schema with a ``pattern``, and the pattern.
ENVELOPE_PATTERNS: dict[str, re.Pattern[str]] = {
    "tree_id": TREE_ID_PATTERN, "process_id": PROCESS_ID_PATTERN, "timestamp": TIMESTAMP_PATTERN,
    "digest": DIGEST_PATTERN,
}


class EnvelopeInvalid(ValueError):
    """An envelope that does not have the documented members and types."""


class SchemaVersionUnsupported(AgentfoldError):
    """An envelope of a schema version, or of an event type, this code does not know (``unknown_type``):
    stop rather than skip it (skipping would lose the event; setting it aside would leave its
    tree with a gap, or lose its last event without a word)."""

    def __init__(self, version: int, type_name: str | None = None, where: str = "", *, unknown_type: bool = False,
                 **detail: Any) -> None:
        what = f"a {type_name} envelope" if type_name else "an envelope"
        place = f" ({where})" if where else ""
        if unknown_type:
            message = (f"an envelope{place} is of event type {str(type_name)[:80]!r}, which this consumer does not know "
                       f"(an event of a later release); it knows {', '.join(EVENT_TYPES)}")
        else:
            message = (f"{what}{place} has schema_version {version}; this consumer knows "
                       f"{SCHEMA_VERSION} ({', '.join(f'{k} {v}' for k, v in SCHEMA_VERSIONS.items())})")
        super().__init__(
            "feed.schema_version_unsupported", message,
            hint="upgrade the consumer to a release that knows this event type and schema version, then restart it",
            **detail,
        )
        self.version = version
        self.type_name = type_name
        self.unknown_type = unknown_type


class TranscriptGap(ValueError):
    """An envelope arrived after a missing position of its tree: an event was lost upstream."""

    def __init__(self, tree_id: str, expected: int, got: int) -> None:
        super().__init__(f"tree {tree_id}: expected position {expected}, got {got} (an event is missing)")
        self.tree_id = tree_id
        self.expected = expected
        self.got = got


def check_envelope(envelope: Any) -> Envelope:
    """The envelope itself if it has exactly the documented members with their types, else raise."""
    if not isinstance(envelope, Mapping):
        raise EnvelopeInvalid("an envelope is a JSON object")
    missing = [m for m in ENVELOPE_MEMBERS if m not in envelope]
    extra = sorted(set(envelope) - set(ENVELOPE_MEMBERS))
    if missing or extra:
        raise EnvelopeInvalid(f"envelope members: missing {missing}, unexpected {extra}")
    for name in ("notification_id", "position", "schema_version"):
        value = envelope[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EnvelopeInvalid(f"{name} must be a positive integer, not {value!r}")
    for name in ("tree_id", "process_id", "type", "timestamp", "digest"):
        if not isinstance(envelope[name], str) or not envelope[name]:
            raise EnvelopeInvalid(f"{name} must be a non-empty string")
    if not TREE_ID_PATTERN.fullmatch(str(envelope["tree_id"])):
        raise EnvelopeInvalid(f"tree_id must be a tree id (tree:<32 hex>), not {str(envelope['tree_id'])[:80]!r}")
    if not DIGEST_PATTERN.fullmatch(str(envelope["digest"])):
        raise EnvelopeInvalid(f"digest must be sha256:<64 lowercase hex>, not {str(envelope['digest'])[:80]!r}")
    # A record of another form is not an event the publisher wrote, even with a digest that
    # chains over what it carries (anyone can compute one): set aside, never a transcript.
    if not PROCESS_ID_PATTERN.fullmatch(str(envelope["process_id"])):
        raise EnvelopeInvalid(f"process_id must be a process id (process:<lowercase hex>), "
                              f"not {str(envelope['process_id'])[:80]!r}")
    if not TIMESTAMP_PATTERN.fullmatch(str(envelope["timestamp"])):
        raise EnvelopeInvalid(f"timestamp must be UTC as YYYY-MM-DDTHH:MM:SS[.fraction]Z, "
                              f"not {str(envelope['timestamp'])[:80]!r}")
    known = envelope["type"] in EVENT_TYPES
    # Only a record of the envelope schema can be an event of a later release: of an event type
    # agentfold writes in a schema version this code does not know, or (checked below, once
    # the rest of the envelope is the schema's) of an event type a later release added. The
    # consumer stops on it: skipping it would lose the event (the tree's next record then
    # stopped it as a gap, and a tree's last event was lost without a word). Anything else
    # (another system's record on the topic) is set aside like any record of another form.
    if known and not supported_version(envelope["type"], envelope["schema_version"]):
        raise SchemaVersionUnsupported(envelope["schema_version"], envelope["type"])
    if not isinstance(envelope["payload"], Mapping):
        raise EnvelopeInvalid("payload must be an object (the stored event body)")
    if envelope["process_id"] != envelope["payload"].get("process_id"):
        # The digest covers the payload, not this copy of its process id: a record that changed
        # only the copy would chain, and be filed under another Process.
        raise EnvelopeInvalid("process_id must be the payload's process_id")
    if not known:
        raise SchemaVersionUnsupported(envelope["schema_version"], envelope["type"], unknown_type=True)
    return envelope


# ---------------------------------------------------------------------------
# Small readers for JSON bodies (defensive: a payload is whatever was stored)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def content_text(content: Any) -> str:
    """The text of a chat message's content: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in _list(content) if isinstance(p, dict) and p.get("type") == "text")


def _call_json(call: Any) -> dict[str, Any]:
    c = _dict(call)
    return {"id": c.get("id"), "name": c.get("name"), "arguments": c.get("arguments")}


def _tool_key_parts(key: str) -> tuple[int, int] | None:
    """``interaction.tool.<sequence>.<index>`` -> (sequence, index)."""
    seq_text, _, index_text = key[len(TOOL_CHILD_PREFIX) :].partition(".")
    if not (seq_text.isdigit() and index_text.isdigit()):
        return None
    return int(seq_text), int(index_text)


# ---------------------------------------------------------------------------
# The per-tree builder


class TreeTranscripts:
    """The transcripts of one tree, advanced one envelope at a time."""

    def __init__(self, tree_id: str, state: Mapping[str, Any] | None = None) -> None:
        self.tree_id = tree_id
        s: dict[str, Any] = copy.deepcopy(dict(state)) if state is not None else {}
        self.position: int = int(s.get("position", 0))
        self.notification_id: int = int(s.get("notification_id", 0))
        # The digest of the envelope at ``position`` (None before the first, or in a state saved by
        # a release that did not keep it): what the next envelope's digest must chain onto.
        self.digest: str | None = s.get("digest")
        # Live Processes: relation, role and what is needed until they end.
        self._processes: dict[str, dict[str, Any]] = s.get("processes", {})
        # Declared start_child Effects not yet started or refused.
        self._starts: dict[str, dict[str, Any]] = s.get("starts", {})
        # Dispatcher Effects of Interactions and Tool children not yet definite.
        self._effects: dict[str, dict[str, Any]] = s.get("effects", {})
        # The open round of each Interaction (its calls and the cursor of results).
        self._rounds: dict[str, dict[str, Any]] = s.get("rounds", {})
        # Transcript headers, by Interaction process id.
        self.headers: dict[str, dict[str, Any]] = s.get("transcripts", {})
        # The last succeeded settlements of each live Process ([effect id, payload], oldest
        # first): a ProcessTerminated may refer to one for its output (``output_of``).
        self._settled: dict[str, list[list[Any]]] = s.get("settled", {})
        # The input of the last child each live Process started of each Program ({parent:
        # {program: [key, input]}}): a later start of the same Program may store its input as
        # changes from it (``input_patch``).
        self._last_inputs: dict[str, dict[str, list[Any]]] = s.get("last_inputs", {})
        self._out: list[Entry] = []
        self._env: Envelope = {}

    def to_json(self) -> dict[str, Any]:
        return {
            "tree_id": self.tree_id,
            "position": self.position,
            "notification_id": self.notification_id,
            "digest": self.digest,
            "processes": self._processes,
            "starts": self._starts,
            "effects": self._effects,
            "rounds": self._rounds,
            "transcripts": self.headers,
            "settled": self._settled,
            "last_inputs": self._last_inputs,
        }

    # -- entry point ---------------------------------------------------------

    def apply(self, envelope: Envelope) -> list[Entry] | None:
        """The entries this envelope adds; None when it is a duplicate (already applied)."""
        if envelope["tree_id"] != self.tree_id:
            raise EnvelopeInvalid(f"envelope of tree {envelope['tree_id']} given to tree {self.tree_id}")
        if not supported_version(envelope.get("type"), envelope.get("schema_version")):
            raise SchemaVersionUnsupported(envelope.get("schema_version"))  # type: ignore[arg-type]
        position = int(envelope["position"])
        if position <= self.position:
            return None
        if position != self.position + 1:
            raise TranscriptGap(self.tree_id, self.position + 1, position)
        self._out = []
        self._env = envelope
        handler = getattr(self, "_on_" + str(envelope["type"]), None)
        if handler is not None:
            handler(str(envelope["process_id"]), _dict(envelope["payload"]))
        self.position = position
        self.notification_id = int(envelope["notification_id"])
        self.digest = str(envelope["digest"])
        out, self._out = self._out, []
        return out

    # -- emitting --------------------------------------------------------------

    def _emit(self, process_id: str, kind: str, body: dict[str, Any]) -> None:
        header = self.headers[process_id]
        header["entry_count"] += 1
        header["updated_notification_id"] = int(self._env["notification_id"])
        entry: Entry = {
            "process_id": process_id,
            "seq": header["entry_count"],
            "kind": kind,
            "notification_id": int(self._env["notification_id"]),
            "position": int(self._env["position"]),
            "timestamp": self._env["timestamp"],
        }
        entry.update(body)
        self._out.append(entry)

    def _is_interaction(self, process_id: str | None) -> bool:
        return process_id is not None and process_id in self.headers and self.headers[process_id]["status"] == "running"

    def _has_transcript(self, process_id: str | None) -> bool:
        """An Interaction's, running or ended."""
        return process_id is not None and process_id in self.headers

    def _become_interaction(self, process_id: str) -> None:
        if process_id in self.headers:
            return
        process = self._processes.get(process_id, {})
        self.headers[process_id] = {
            "process_id": process_id,
            "tree_id": self.tree_id,
            "parent_process_id": process.get("parent"),
            "tool_call_ref": process.get("ref") if process.get("role") == "delegate" else None,
            "status": "running",
            "entry_count": 0,
            "created_notification_id": int(self._env["notification_id"]),
            "updated_notification_id": int(self._env["notification_id"]),
        }
        for message in _list(_dict(process.pop("input", None)).get("messages")):
            m = _dict(message)
            body: dict[str, Any] = {"role": m.get("role"), "content": m.get("content"), "text": content_text(m.get("content"))}
            if m.get("tool_calls"):
                body["tool_calls"] = [_call_json(c) for c in _list(m.get("tool_calls"))]
            if m.get("tool_results"):
                body["tool_results"] = m.get("tool_results")
            self._emit(process_id, "input_message", body)

    def _owner(self, process_id: str) -> tuple[str | None, str | None]:
        """The Interaction a Process reports to and the ToolCallRef it serves (Tool children)."""
        process = self._processes.get(process_id, {})
        if process.get("role") == "tool":
            return process.get("parent"), process.get("ref")
        return process_id, None

    # -- events ----------------------------------------------------------------

    def _on_TreeStarted(self, pid: str, p: dict[str, Any]) -> None:
        self._processes[pid] = {"parent": None, "key": None, "role": None, "input": p.get("input")}

    def _on_EffectDeclared(self, pid: str, p: dict[str, Any]) -> None:
        effect_id = str(p.get("effect_id"))
        payload = _dict(p.get("payload"))
        if p.get("target") == "framework":
            operation = payload.get("operation")
            if operation == "start_child":
                self._starts[effect_id] = {
                    "parent": pid, "key": payload.get("key"), "program": payload.get("program"),
                    "input": self._rebuilt_input(pid, payload)
                    if self._env.get("schema_version") == 2 and holds_input_patch("framework", payload)
                    else payload.get("input"),
                }
            elif operation == "wait" and payload.get("key") == TOOL_INPUT_WAIT_KEY:
                owner, ref = self._owner(pid)
                if self._is_interaction(owner) and ref is not None:
                    schema = _dict(_dict(payload.get("response_schema")).get("properties")).get("input_response")
                    self._emit(str(owner), "input_prompt", {
                        "tool_call_ref": ref, "tool_process_id": pid,
                        "wait_id": str(wait_id_for(EffectID(effect_id))),
                        "prompt": payload.get("prompt"), "response_schema": schema,
                    })
            return
        if "model_call" in payload or "prepare_context" in payload:
            self._become_interaction(pid)
            if "model_call" in payload:
                call = _dict(payload["model_call"])
                self._effects[effect_id] = {
                    "kind": "model", "process": pid, "sequence": call.get("model_call_sequence"),
                    "steer": _list(call.get("applied_steer_signal_ids")),
                }
            else:
                self._effects[effect_id] = {"kind": "context", "process": pid}
        elif "tool_call" in payload and self._processes.get(pid, {}).get("role") == "tool":
            self._effects[effect_id] = {"kind": "tool", "process": pid}

    def _rebuilt_input(self, parent: str, payload: dict[str, Any]) -> Any:
        """A child input stored as changes (``input_patch``) from the input of an earlier child of
        ``parent``: rebuilt when that child is the last of its Program ``parent`` started (what
        agentfold writes: a team's turns, each from the one before), else None."""
        patch = payload.get(INPUT_PATCH)
        base = patch.get("base") if isinstance(patch, dict) else None
        ops = patch.get("ops") if isinstance(patch, dict) else None
        for key, value in self._last_inputs.get(parent, {}).values():
            if key == base and isinstance(ops, list):
                # Only the members the builder reads are kept (``_read_members``), and the ops on them.
                read = [op for op in ops if isinstance(op, dict) and isinstance(op.get("path"), list)
                        and (not op["path"] or op["path"][0] in READ_MEMBERS)]
                try:
                    return _read_members(apply_changes(value, read))
                except ValueError:
                    return None
        return None

    def _on_ProcessStarted(self, pid: str, p: dict[str, Any]) -> None:
        start = self._starts.pop(str(p.get("start_effect_id")), {})
        parent = str(p.get("parent_id"))
        key = str(start.get("key") or "")
        process: dict[str, Any] = {"parent": parent, "key": key, "role": None, "input": start.get("input")}
        self._processes[pid] = process
        self._last_inputs.setdefault(parent, {})[str(start.get("program"))] = [key, _read_members(start.get("input"))]
        if not self._is_interaction(parent):
            return
        if key.startswith(TOOL_CHILD_PREFIX):
            parts = _tool_key_parts(key)
            if parts is not None:
                process["role"] = "tool"
                process["ref"] = f"{parent}/{parts[0]}/{parts[1]}"
                process["call"] = _call_json(_dict(process.pop("input", None)).get("call"))
        elif key.startswith(DELEGATE_CHILD_PREFIX):
            found = self._delegate_call(parent, key)
            process["role"] = "delegate"
            process["ref"] = found[0] if found else None
            call = found[1] if found else {}
            self._emit(parent, "delegate_start", {
                "tool_call_ref": process["ref"], "tool_call_id": call.get("id"), "delegate_name": call.get("name"),
                "child_process_id": pid, "child_key": key, "started": True, "input": process.get("input"),
            })

    def _delegate_call(self, parent: str, key: str) -> tuple[str, dict[str, Any]] | None:
        """The call of the parent's open round that a Delegate child key was derived from."""
        r = self._rounds.get(parent)
        if r is None:
            return None
        for index, call in enumerate(r["calls"]):
            if call.get("id") and call.get("name"):
                if delegate_child_key(int(r["sequence"]), str(call["id"]), str(call["name"])) == key:
                    return f"{parent}/{r['sequence']}/{index}", call
        return None

    def _on_SignalAdmitted(self, pid: str, p: dict[str, Any]) -> None:
        payload = _dict(p.get("payload"))
        owner, ref = self._owner(pid)
        if not self._is_interaction(owner):
            return
        assert owner is not None
        if ref is None and "steer" in payload:
            messages = _list(_dict(payload["steer"]).get("messages"))
            self._emit(owner, "steering", {
                "signal_id": p.get("signal_id"), "messages": messages,
                "text": "\n".join(content_text(_dict(m).get("content")) for m in messages),
            })
        elif ref is not None and p.get("wait_id") is not None and "input_response" in payload:
            self._emit(owner, "input_answer", {
                "tool_call_ref": ref, "tool_process_id": pid, "wait_id": p.get("wait_id"),
                "signal_id": p.get("signal_id"), "answer": payload["input_response"],
            })

    def _on_StepCommitted(self, pid: str, p: dict[str, Any]) -> None:
        if not self._is_interaction(pid):
            return
        for op in _list(_dict(p.get("facts")).get("ops")):
            self._round_op(pid, _dict(op))

    def _round_op(self, pid: str, op: dict[str, Any]) -> None:
        name = op.get("op")
        r = self._rounds.get(pid)
        if name == "user":
            self._emit(pid, "feedback", {"text": op.get("text")})
        if r is None:
            return
        if name == "reject":
            self._interaction_result(pid, r, int(r["cursor"]), "rejected", op.get("text"))
            r["cursor"] = int(r["cursor"]) + 1
        elif name == "start_batch":
            r["batch"] = {"kind": op.get("kind"), "start": r["cursor"], "size": int(op.get("size", 0)), "outputs": {}}
        elif name == "record_starts" and r.get("batch"):
            for offset_text, text in sorted(_dict(op.get("rejected")).items(), key=lambda kv: int(kv[0])):
                self._interaction_result(pid, r, int(r["batch"]["start"]) + int(offset_text), "rejected", text)
        elif name == "record_outcomes" and r.get("batch") and r["batch"]["kind"] == "delegate":
            b = r["batch"]
            failed = _dict(op.get("failed"))
            for offset in range(int(b["size"])):
                index = int(b["start"]) + offset
                if str(offset) in failed:
                    self._interaction_result(pid, r, index, "failed", failed[str(offset)])
                elif str(index) in b["outputs"]:
                    self._emit_result(pid, r, index, "succeeded", {"details": b["outputs"].pop(str(index))}, "delegate")
        elif name == "finish_batch" and r.get("batch"):
            r["cursor"] = int(r["batch"]["start"]) + int(r["batch"]["size"])
            r["batch"] = None
        elif name == "finish_round":
            self._rounds.pop(pid, None)

    def _interaction_result(self, pid: str, r: dict[str, Any], index: int, disposition: str, text: Any) -> None:
        """A result the Interaction itself gave the model (a call it refused or a Delegate that failed)."""
        output = {"content": [{"type": "text", "text": str(text)}]}
        self._emit_result(pid, r, index, disposition, output, "interaction")

    def _emit_result(
        self, pid: str, r: dict[str, Any], index: int, disposition: str, output: Any, source: str
    ) -> None:
        reported = r.setdefault("reported", [])
        if index in reported:
            return
        reported.append(index)
        calls = r["calls"]
        call = calls[index] if 0 <= index < len(calls) else {}
        self._emit(pid, "tool_result", {
            "tool_call_ref": f"{pid}/{r['sequence']}/{index}", "tool_call_id": call.get("id"),
            "tool_name": call.get("name"), "source": source, "status": "completed",
            "disposition": disposition, "output": output, "text": content_text(_dict(output).get("content")),
        })

    def _keep_settled(self, pid: str, effect_id: str, payload: Any) -> None:
        """Remember a succeeded result of a Tool or Delegate child (only their outputs are
        reported), the last ``SETTLED_KEPT`` of each, until the child ends."""
        if self._processes.get(pid, {}).get("role") not in ("tool", "delegate"):
            return
        kept = self._settled.setdefault(pid, [])
        kept.append([effect_id, payload])
        del kept[:-SETTLED_KEPT]

    def _output(self, pid: str, p: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        """A ProcessTerminated's output: inline, or where ``output_of`` says it is stored.

        Returns ``(output, None)``, or ``(None, output_of)`` when the reference cannot be
        resolved from what this builder kept (a settlement applied by an older release, or
        one a custom Program completed with long after): the entry then says so
        (``output_unresolved``) rather than stopping the consumer or inventing a null output.
        """
        ref = p.get("output_of")
        if not isinstance(ref, Mapping):
            return p.get("output"), None
        for effect_id, payload in reversed(self._settled.get(pid, [])):
            if effect_id == ref.get("effect_id"):
                value = payload
                for key in _list(ref.get("path")):
                    if not isinstance(value, Mapping) or str(key) not in value:
                        return None, dict(ref)
                    value = value[str(key)]
                return value, None
        return None, dict(ref)

    def _on_EffectSettled(self, pid: str, p: dict[str, Any]) -> None:
        effect_id = str(p.get("effect_id"))
        status = p.get("status")
        if status == "succeeded":
            self._keep_settled(pid, effect_id, p.get("payload"))
        start = self._starts.get(effect_id)
        if start is not None:
            if status == "failed":
                self._refused_start(effect_id, start, _dict(p.get("payload")))
            return
        effect = self._effects.get(effect_id)
        if effect is None:
            return
        if status == "unknown":
            self._unknown(effect_id, effect, p.get("diagnostic"))
            return
        del self._effects[effect_id]
        if status == "succeeded":
            self._definite(effect, p.get("payload"))

    def _refused_start(self, effect_id: str, start: dict[str, Any], payload: dict[str, Any]) -> None:
        del self._starts[effect_id]
        parent = str(start.get("parent"))
        key = str(start.get("key") or "")
        if self._is_interaction(parent) and key.startswith(DELEGATE_CHILD_PREFIX):
            found = self._delegate_call(parent, key)
            call = found[1] if found else {}
            self._emit(parent, "delegate_start", {
                "tool_call_ref": found[0] if found else None, "tool_call_id": call.get("id"),
                "delegate_name": call.get("name"), "child_process_id": None, "child_key": key, "started": False,
                "failure": payload.get("failure"),
            })

    def _unknown(self, effect_id: str, effect: dict[str, Any], diagnostic: Any) -> None:
        owner, ref = self._owner(str(effect["process"]))
        if not self._is_interaction(owner):
            return
        assert owner is not None
        body: dict[str, Any] = {"effect_id": effect_id, "effect_kind": effect["kind"], "diagnostic": diagnostic}
        if effect["kind"] == "model":
            body["model_call_sequence"] = effect.get("sequence")
        if ref is not None:
            body["tool_call_ref"] = ref
        self._emit(owner, "unknown_outcome", body)

    def _definite(self, effect: dict[str, Any], payload: Any) -> None:
        if effect["kind"] != "model":
            return  # tool results are reported when the Tool child ends; a prepared context is not a message
        pid = str(effect["process"])
        if not self._is_interaction(pid):
            return
        response = _dict(_dict(_dict(payload).get("model_result")).get("response"))
        message = _dict(response.get("message"))
        sequence = effect.get("sequence")
        calls = [_call_json(c) for c in _list(message.get("tool_calls"))]
        for index, call in enumerate(calls):
            call["tool_call_ref"] = f"{pid}/{sequence}/{index}"
        body: dict[str, Any] = {
            "model_call_sequence": sequence, "content": message.get("content"), "text": content_text(message.get("content")),
            "tool_calls": calls, "finish_reason": response.get("finish_reason"),
            "applied_steer_signal_ids": effect.get("steer", []),
        }
        if response.get("usage") is not None:
            body["usage"] = response["usage"]
        self._emit(pid, "assistant_message", body)
        if calls and response.get("finish_reason") in ("tool_calls", "length"):
            self._rounds[pid] = {
                "sequence": sequence, "calls": [{k: c[k] for k in ("id", "name")} for c in calls],
                "cursor": 0, "batch": None, "reported": [],
            }

    def _on_EffectResolved(self, pid: str, p: dict[str, Any]) -> None:
        effect_id = str(p.get("effect_id"))
        if p.get("status") == "succeeded":
            self._keep_settled(pid, effect_id, p.get("payload"))
        effect = self._effects.pop(effect_id, None)
        if effect is None:
            return
        owner, ref = self._owner(str(effect["process"]))
        if not self._is_interaction(owner):
            return
        assert owner is not None
        body: dict[str, Any] = {
            "effect_id": effect_id, "effect_kind": effect["kind"], "status": p.get("status"),
            "resolved_by": p.get("resolved_by", "host"), "payload": p.get("payload"),
        }
        if ref is not None:
            body["tool_call_ref"] = ref
        self._emit(owner, "unknown_resolved", body)
        if p.get("status") == "succeeded":
            self._definite(effect, p.get("payload"))

    def _on_ProcessTerminated(self, pid: str, p: dict[str, Any]) -> None:
        unresolved: dict[str, Any] | None = None
        if p.get("output_of") is not None:
            output, unresolved = self._output(pid, p)
            p = {**p, "output": output}
        self._settled.pop(pid, None)
        self._last_inputs.pop(pid, None)
        process = self._processes.pop(pid, {})
        status = str(p.get("status"))
        ending = {k: p[k] for k in ("cause", "reason", "failure") if p.get(k) not in (None, "")}
        parent = process.get("parent")
        role = process.get("role")
        # A child's end belongs in its Interaction's transcript also when the Interaction ended
        # first: a canceled or killed Interaction ends before the children it stops (their
        # calls, unknown ones included, are reported after its `failure` entry).
        if role == "tool" and self._has_transcript(parent):
            call = process.get("call") or {}
            completion = _dict(p.get("output"))
            body: dict[str, Any] = {
                "tool_call_ref": process.get("ref"), "tool_call_id": call.get("id"), "tool_name": call.get("name"),
                "source": "tool", "status": status,
                "disposition": completion.get("disposition") if status == "completed" else None,
                "output": completion.get("output") if status == "completed" else None,
                "text": content_text(_dict(completion.get("output")).get("content")) if status == "completed" else "",
            }
            body.update(ending)
            if unresolved is not None:
                body["output_unresolved"] = unresolved
            if p.get("unresolved_effect_ids"):
                body["unresolved_effect_ids"] = p["unresolved_effect_ids"]
            self._emit(str(parent), "tool_result", body)
            r = self._rounds.get(str(parent))
            ref = str(process.get("ref") or "")
            if r is not None and ref.count("/") == 2:
                r.setdefault("reported", []).append(int(ref.rsplit("/", 1)[1]))
        elif role == "delegate" and self._has_transcript(parent):
            body = {"tool_call_ref": process.get("ref"), "child_process_id": pid, "status": status}
            if status == "completed":
                body["output"] = p.get("output")
                if unresolved is not None:
                    body["output_unresolved"] = unresolved
            body.update(ending)
            if p.get("unresolved_effect_ids"):
                body["unresolved_effect_ids"] = p["unresolved_effect_ids"]
            self._emit(str(parent), "delegate_result", body)
            r = self._rounds.get(str(parent))
            ref = str(process.get("ref") or "")
            if r is not None and r.get("batch") and status == "completed" and ref.count("/") == 2:
                r["batch"]["outputs"][ref.rsplit("/", 1)[1]] = p.get("output")
        if self._is_interaction(pid):
            if status == "completed":
                output = p.get("output")
                response = _dict(_dict(output).get("model_response"))
                final: dict[str, Any] = {
                    "output": output, "text": content_text(_dict(response.get("message")).get("content")),
                }
                if unresolved is not None:
                    final["output_unresolved"] = unresolved
                self._emit(pid, "final_output", final)
            else:
                body = {"status": status, **ending}
                if p.get("unresolved_effect_ids"):
                    body["unresolved_effect_ids"] = p["unresolved_effect_ids"]
                self._emit(pid, "failure", body)
            self.headers[pid]["status"] = status
            self._rounds.pop(pid, None)


# ---------------------------------------------------------------------------
# Whole transcripts


def transcript_json(header: Mapping[str, Any], entries: Iterable[Entry]) -> dict[str, Any]:
    """One transcript as ``agentfold transcript --json`` prints it: the header and its entries."""
    return {**header, "entries": list(entries)}


def build_transcripts(envelopes: Iterable[Envelope]) -> dict[str, dict[str, Any]]:
    """Every transcript the envelopes make, by Interaction process id (duplicates skipped).

    Envelopes of different trees may be interleaved; each tree's must come in position
    order, as a partition delivers them.
    """
    trees: dict[str, TreeTranscripts] = {}
    entries: dict[str, list[Entry]] = {}
    for envelope in envelopes:
        check_envelope(envelope)
        tree_id = str(envelope["tree_id"])
        builder = trees.get(tree_id)
        if builder is None:
            builder = trees[tree_id] = TreeTranscripts(tree_id)
        for entry in builder.apply(envelope) or ():
            entries.setdefault(entry["process_id"], []).append(entry)
    out: dict[str, dict[str, Any]] = {}
    for builder in trees.values():
        for process_id, header in builder.headers.items():
            out[process_id] = transcript_json(header, entries.get(process_id, []))
    return out
