"""Identities a user or a stored tree relies on (mutation audit, area ``ids``).

* A tree id is stored (the stream's key, the index row) and recomputed from the start id on every
  idempotent start and every ``agentfold show START_ID``: a release that derived it otherwise would
  no longer find a single stored tree. It is pinned here to values computed by hand, not by the
  code under test.
* The canonical hex and derived ids have a fixed prefix: text with another prefix of the same
  length is not that id (``identity.invalid``, nothing appended), never looked up as another one.
* A root process id is ``process:`` + 32 lowercase hex (scope-kernel.md §1.1; docs/concepts.md).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import EngineCode, InvalidInput, ResourceLimitExceeded
from agentfold.domain.events import SignalAdmitted, TreeLimits, TreeStarted
from agentfold.domain.ids import Digest, EffectAttemptID, SignalID, TreeID, TreeIncarnationID
from agentfold.domain.program import (
    Complete,
    Continue,
    Descriptor,
    Program,
    Signal,
    SignalRequest,
    Step,
    dispatcher_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from tests.bad_input_programs import listener_program, pair_program, two_waits_program
from tests.kernel_programs import IMPL, JsonStrategy, config_digest
from tests.test_mutants_inputs import _contents

WAIT = 10.0


def _spec_tree_id(start_id: str) -> str:
    """How a tree id is made (agentfold/domain/ids.py docstring, docs/concepts.md "derived from the
    start id"): the kernel's derive rule (scope-kernel.md §1.3: SHA-256 of the tag and the parts
    joined with NUL) with tag ``tree`` and the start id as the only part, cut to the first 16
    bytes, written as ``tree:`` + 32 lowercase hex."""
    return "tree:" + hashlib.sha256(b"tree\x00" + start_id.encode("ascii")).digest()[:16].hex()


def test_a_tree_id_and_its_stored_stream_key_are_the_ones_earlier_releases_derived_from_the_start_id(
    tmp_path: Path,
) -> None:
    # The value docs/cli.md shows for start id "bad" (written by an earlier release) is also what
    # the formula gives: a stored tree stays reachable by its start id after an upgrade.
    assert _spec_tree_id("bad") == "tree:53d1d9f2dec4f60c5a1eb463411b5ea5"
    path = tmp_path / "ids.db"
    store = EventStore(f"sqlite:///{path}")
    try:
        with Runtime(store) as runtime:
            for start_id, expected in (("bad", "tree:53d1d9f2dec4f60c5a1eb463411b5ea5"),
                                       ("order-42:retry.1", _spec_tree_id("order-42:retry.1"))):
                handle = runtime.start(listener_program(), None, start_id=start_id)
                runtime.wait_idle(handle.tree_id, timeout=WAIT)
                assert handle.tree_id == expected
                assert store.find_tree(start_id) == expected
    finally:
        store.close()
    # The event stream's key in the file is the tree id's hex (a UUID in hex): what a release
    # reading this file looks the tree up by.
    with sqlite3.connect(path) as db:
        keys = {row[0] for row in db.execute("SELECT DISTINCT originator_id FROM agentfold_events")}
        indexed = {row[0] for row in db.execute("SELECT tree_id FROM agentfold_trees")}
    assert {k.replace("-", "") for k in keys} == {_spec_tree_id("bad")[5:], _spec_tree_id("order-42:retry.1")[5:]}
    assert indexed == {_spec_tree_id("bad"), _spec_tree_id("order-42:retry.1")}


def test_a_root_process_id_is_process_and_32_lowercase_hex_digits(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(listener_program(), None, start_id="root-id")
            tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
    finally:
        store.close()
    assert re.fullmatch(r"process:[0-9a-f]{32}", tree.root.process_id), tree.root.process_id
    assert handle.root_process_id == tree.root.process_id


class _Done(JsonStrategy):
    def decide(self, state: Any, window: Any) -> Any:  # pragma: no cover - never started
        raise AssertionError("not started")


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        # Same length as the real prefix, so only the prefix check can tell them apart.
        (Digest, "SHA256:" + "a" * 64),
        (Digest, "sha512:" + "a" * 64),
        (TreeID, "trex:" + "0" * 32),
        (TreeIncarnationID, "incarnatio:x" + "0" * 32),
        (EffectAttemptID, "attempts" + "0" * 32),
    ],
)
def test_a_hex_id_with_another_prefix_of_the_same_length_is_refused(kind: type, value: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        kind(value)
    assert caught.value.code == "identity.invalid" and repr(value[:80]) in caught.value.message


def test_a_program_whose_digest_names_another_algorithm_is_refused() -> None:
    # A Program's implementation and configuration digests become part of its stored ProgramRef.
    wrong: list[tuple[Any, Any]] = [("sha512:" + IMPL.hex, config_digest("x")), (IMPL, "SHA256:" + IMPL.hex)]
    for implementation, configuration in wrong:
        with pytest.raises(InvalidInput) as caught:
            Program(Descriptor("test.ids.algorithm"), _Done(), implementation, configuration)
        assert caught.value.code == "identity.invalid"


def test_an_effect_id_with_another_prefix_or_an_extra_character_is_refused_and_resolves_nothing(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(pair_program(), None, start_id="effect-prefix")
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            unknown = root.unknown_effects()[0].effect_id
            before = _contents(store)
            # Another prefix of the same length, and one character too many.
            hex64 = unknown.removeprefix("effect:")
            for wrong in ("EFFECT:" + hex64, "waits::" + hex64, unknown + "0"):
                with pytest.raises(InvalidInput) as caught:
                    runtime.resolve_unknown_effect(wrong, Settlement.succeeded(), process_id=root.process_id)
                assert caught.value.code == "identity.invalid" and "'effect:'" in caught.value.hint
                with pytest.raises(InvalidInput) as caught:
                    Host(runtime).resolve(wrong, output={"ok": True})
                assert caught.value.code == "identity.invalid"
            assert _contents(store) == before
            assert [e.effect_id for e in runtime.capture(handle.tree_id).root.unknown_effects()] == [unknown]
    finally:
        store.close()


def test_a_wait_id_with_another_prefix_or_an_extra_character_is_refused_and_answers_nothing(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(two_waits_program(), None, start_id="wait-prefix")
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            current = root.current_wait
            assert current is not None and current.startswith("wait:")
            before = _contents(store)
            for wrong in ("WAIT:" + current.removeprefix("wait:"), current + "0"):
                with pytest.raises(InvalidInput) as caught:
                    Host(runtime).answer(root.process_id, wrong, {"name": "n"})
                assert caught.value.code == "identity.invalid" and "'wait:'" in caught.value.hint
            assert _contents(store) == before
            assert runtime.capture(handle.tree_id).root.current_wait == current
    finally:
        store.close()


# ---------------------------------------------------------------------------
# Canonical JSON: what a Program sees live is what it sees after recovery


class _ReturnsATuple(JsonStrategy):
    """Step 1 returns facts holding a tuple; step 2 reports what its state then holds."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue(()), {"phase": "next", "pair": (1, 2)})
        return Step(0, Complete({"pair": state["pair"], "pair_is_a_list": state["pair"] == [1, 2]}))


def test_a_program_sees_its_facts_as_the_stored_json_in_the_live_run_not_the_objects_it_returned(
    tmp_path: Path,
) -> None:
    # The store holds the facts' JSON (a tuple is an array, read back as a list): a recovered run
    # folds that. The live run must decide on the same values, or it decides otherwise live than
    # after a crash (here: "pair_is_a_list" False live, True after recovery).
    program = Program(Descriptor("test.ids.tuple"), _ReturnsATuple(), IMPL, config_digest("test.ids.tuple"))
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, None, start_id="tuple-facts")
            result = runtime.result(handle.tree_id, timeout=WAIT)
    finally:
        store.close()
    assert (result.status, result.output) == ("completed", {"pair": [1, 2], "pair_is_a_list": True})


@pytest.mark.parametrize("bound", [-(1 << 63), (1 << 64) - 1], ids=["int64-min", "uint64-max"])
def test_an_integer_at_the_64_bit_bounds_is_taken_and_comes_back_unchanged(tmp_path: Path, bound: int) -> None:
    # The null next to it makes normalize walk the value (orjson writes NaN as null too).
    payload = {"n": bound, "none": None}
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(listener_program(), payload, start_id="bounds")
            runtime.wait_idle(handle.tree_id, timeout=WAIT)
            pid = handle.root_process_id
            assert runtime.deliver_signals(pid, [SignalRequest(SignalID("bound"), {"text": "t", **payload})])
        stored = [record.event for record in store.read(handle.tree_id)]
        assert [e.input for e in stored if isinstance(e, TreeStarted)] == [payload]
        assert [e.payload for e in stored if isinstance(e, SignalAdmitted)] == [{"text": "t", **payload}]
    finally:
        store.close()
    for beyond in (-(1 << 63) - 1, 1 << 64):
        with pytest.raises(InvalidInput) as caught:
            SignalRequest(SignalID("beyond"), {"n": beyond, "none": None})
        assert caught.value.code == "payload.invalid"


# ---------------------------------------------------------------------------
# Mailbox: a settlement on its way holds its place


class _CallsThenCounts(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue((dispatcher_effect({"call": "slow"}),)), {"phase": "calling"})
        return Step(len(window), Complete({"seen": len(window)}), {"phase": "done"})


def test_the_mailbox_keeps_room_for_the_settlement_of_an_effect_in_flight(tmp_path: Path) -> None:
    called, gate = threading.Event(), threading.Event()

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        called.set()
        if not gate.wait(WAIT):
            raise TimeoutError("the test never opened the gate")
        return Settlement.succeeded({"value": 1})

    name = "test.ids.calls_then_counts"
    program = Program(Descriptor(name, signal_schema={"type": "object"}), _CallsThenCounts(), IMPL,
                      config_digest(name), dispatcher=FunctionDispatcher(call))
    store = EventStore(f"sqlite:///{tmp_path / 'ids.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, None, start_id="room", limits=TreeLimits(max_pending_signals=2))
            assert called.wait(WAIT)
            pid = handle.root_process_id
            before = _contents(store)
            two = [SignalRequest(SignalID(f"s{i}"), {"i": i}) for i in range(2)]
            # 0 pending + 1 settlement reserved + 2 = 3 > 2: the whole batch is refused.
            with pytest.raises(ResourceLimitExceeded) as caught:
                runtime.deliver_signals(pid, two)
            assert caught.value.code == EngineCode.LIMIT_SIGNALS
            assert _contents(store) == before
            assert runtime.deliver_signals(pid, two[:1])
            gate.set()
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert result.status == "completed"
    finally:
        gate.set()
        store.close()
