"""Mutation audit of stored-event encoding and integrity (adapters/codec.py, domain/integrity.py,
domain/canonical.py): each test here fails with a planted bug the rest of the suite let through
(named in its docstring). They look at what is stored with plain SQL and zlib, as an external
verifier following docs/events.md would, or call the pure functions the store reads with.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import COMPRESSED, MAX_STATE_BYTES, stored_json
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.canonical import MAX_PAYLOAD_BYTES, normalize, parse_json_text
from agentfold.domain.errors import InvalidInput
from agentfold.domain.integrity import SealError, chain_digest, seal
from agentfold.domain.program import Continue, Signal, Step, dispatcher_effect
from tests.audit.support import Sql, record_chain
from tests.kernel_programs import CallLog
from tests.test_bad_input import listener_program, refused
from tests.test_mutants_audit import PREFIX, documented_digest, verify_json
from tests.test_output_stored_once import run_interaction
from tests.test_user_program_mistakes import _Changes, _program, _raise


def test_a_version_2_event_is_chained_under_its_topic_with_the_version_suffix(tmp_path: Path) -> None:
    """docs/events.md: the chain's ``event_type`` is the topic after ``domain.events:``, "@2"
    included, "so the schema version is covered by the chain". Mutant: the chain hashed the
    bare type name (``ProcessTerminated``) for a version 2 event; every store still read back
    (writer and reader agreed), only a verifier following the documented formula failed."""
    url = f"sqlite:///{tmp_path / 'v2.db'}"
    store = EventStore(url)
    try:
        tree_id, _ = run_interaction(store, "codec-v2")
    finally:
        store.close()
    rows = Sql(url).rows(tree_id)
    assert "domain.events:ProcessTerminated@2" in [topic for _, topic, _ in rows]
    previous = ""
    for position, topic, state in rows:
        recorded = state[PREFIX:PREFIX + 71].decode()
        content = b"{" + state[PREFIX + 71 + 2:]
        expected = documented_digest(previous, str(tree_id), position, topic.removeprefix("domain.events:"), content)
        assert recorded == expected, f"position {position} ({topic})"
        previous = recorded


def _deflated(data: bytes) -> bytes:
    deflate = zlib.compressobj(1, zlib.DEFLATED, -15)
    return COMPRESSED + deflate.compress(data) + deflate.flush()


def test_a_compressed_state_inflating_to_exactly_the_bound_reads_back_and_one_byte_more_is_refused() -> None:
    """codec.py: a stored state inflates to at most ``MAX_STATE_BYTES``. Mutant: the inflate
    limit was ``limit + 1`` (a state one byte over the bound was read); the existing bomb test
    overshoots by 10 bytes and the writer never gets near the bound."""
    at_bound = b"{" + b" " * (MAX_STATE_BYTES - 2) + b"}"
    assert len(at_bound) == MAX_STATE_BYTES
    assert stored_json(_deflated(at_bound)) == at_bound
    over = b"{" + b" " * (MAX_STATE_BYTES - 1) + b"}"
    with pytest.raises(SealError, match="too large"):
        stored_json(_deflated(over))


def test_a_version_1_event_stored_under_a_topic_spelled_at_1_is_refused_even_chained_again(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """codec.py: version 1 has exactly one spelling (no suffix); a feed consumer rebuilds the
    chain from the envelope's type and version, so ``ProcessTerminated@1`` would chain here and
    not there. Mutant: the ``> 1`` check on the suffix was dropped (``@1`` read as version 1):
    a last event retopiced to ``@1``, chained again and anchored, verified as sound."""
    store = f"sqlite:///{tmp_path / 'at1.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    state = sql.state(tree_id, 15)
    content = b"{" + state[PREFIX + 71 + 2:]
    previous = sql.state(tree_id, 14)[PREFIX:PREFIX + 71].decode()
    digest = chain_digest(previous, str(tree_id), 15, "ProcessTerminated@1", content)
    sql.set_row(tree_id, 15, "domain.events:ProcessTerminated@1", seal(content, digest))
    sql.set_head(tree_id, 15, digest)
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 15, "stream.schema_version")


def test_an_input_that_is_a_bare_string_holding_a_lone_surrogate_is_refused_naming_it(tmp_path: Path) -> None:
    """canonical.normalize: a string given alone is checked for a lone surrogate (orjson refuses
    one only when it encodes, and a short string is not encoded). Mutant: that check was dropped:
    the start was still refused, but only when its TreeStarted failed to encode, saying "do not
    change a payload after building its Effect" instead of naming the surrogate and its fix."""
    store = EventStore(f"sqlite:///{tmp_path / 'surrogate.db'}")
    program = listener_program()
    try:
        with Runtime(store, Catalog([program])) as runtime:
            exc = refused(runtime, lambda: runtime.start(program, "cite \ud800 sources", start_id="s-1"),
                          InvalidInput, "payload.invalid", "lone surrogate", "$")
            assert "errors='replace'" in (exc.hint or "")
            assert store.heads() == []
    finally:
        store.close()


def test_an_input_over_the_payload_limit_in_utf8_bytes_but_not_in_characters_is_refused(tmp_path: Path) -> None:
    """canonical.normalize: the limit is on the canonical encoding's bytes. Mutant: it was measured
    in characters (``len(data.decode())``): 2 MiB of "é" (4 MiB of UTF-8) was accepted and
    stored; every existing oversize test used ASCII, where both measures agree."""
    store = EventStore(f"sqlite:///{tmp_path / 'utf8.db'}")
    program = listener_program()
    text = "é" * (MAX_PAYLOAD_BYTES // 2)  # {"t":"..."} is 8 bytes of framing: 8 bytes over the limit
    try:
        with Runtime(store, Catalog([program])) as runtime:
            refused(runtime, lambda: runtime.start(program, {"t": text}, start_id="s-1"),
                    InvalidInput, "payload.too_large", str(MAX_PAYLOAD_BYTES), str(MAX_PAYLOAD_BYTES + 8))
            assert store.heads() == []
    finally:
        store.close()


def test_every_stored_content_is_canonical_json_as_the_standard_library_writes_it(tmp_path: Path) -> None:
    """docs/events.md: ``content`` is the canonical JSON of the stored object (keys sorted, no
    whitespace), what an external verifier or a feed consumer rebuilds from the values. Mutant:
    canonical_bytes without OPT_SORT_KEYS: writer, reader and audit all agreed (each used the
    same function), so every store still verified; only the stored bytes were not canonical."""
    url = f"sqlite:///{tmp_path / 'sorted.db'}"
    tree_id = record_chain(url)
    rows = Sql(url).rows(tree_id)
    assert len(rows) == 15
    for position, _, state in rows:
        content = b"{" + state[PREFIX + 71 + 2:]
        rebuilt = json.dumps(json.loads(content), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert content == rebuilt.encode(), f"position {position}"


def test_a_stored_state_whose_bytes_after_the_digest_are_changed_is_an_integrity_error_at_its_position(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/events.md: changing any byte of an event's JSON is detected. The two bytes between the
    digest and the content (``",``) are in neither the digest nor the content, so only unseal's
    format check sees them. Mutant: that check was dropped: a row edited there (no longer JSON)
    verified as sound."""
    store = f"sqlite:///{tmp_path / 'splice.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    state = sql.state(tree_id, 5)
    assert state[PREFIX + 71:PREFIX + 73] == b'",'
    topic = next(t for v, t, _ in sql.rows(tree_id) if v == 5)
    sql.set_row(tree_id, 5, topic, state[:PREFIX + 71] + b'";' + state[PREFIX + 73:])
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 5, "integrity.format")


def test_an_object_key_holding_a_lone_surrogate_is_refused_naming_the_key_and_the_surrogate() -> None:
    """canonical._check: a key is text and is checked as text. Mutant: the key's check was dropped:
    the payload was still refused (orjson cannot encode it) but as "payload is not JSON" with the
    hint to pass only dicts and lists, naming neither the key nor the surrogate."""
    with pytest.raises(InvalidInput) as caught:
        normalize({"ok": {"cite \ud800": 1}})
    assert caught.value.code == "payload.invalid"
    assert "a key of $.ok" in caught.value.message and "lone surrogate" in caught.value.message
    assert "errors='replace'" in caught.value.hint


def test_json_text_longer_than_the_limit_whose_canonical_form_fits_is_accepted() -> None:
    """docs/errors.md: ``payload.too_large`` is "a payload above its limit (4 MiB of canonical
    JSON)"; a file given as ``--input @PATH`` may be indented. Mutant: parse_json_text's early
    bound on the text was the limit itself (measured before normalization): a payload within the
    limit, written with whitespace, was refused as too large."""
    blob = "x" * (MAX_PAYLOAD_BYTES - 100)
    text = '{\n    "t":' + " " * 200 + f'"{blob}"\n}}\n'
    assert len(text.encode()) > MAX_PAYLOAD_BYTES
    assert parse_json_text(text) == {"t": blob}
    with pytest.raises(InvalidInput) as caught:
        parse_json_text('{"t":' + " " * 200 + f'"{blob}x{"y" * 200}"}}')
    assert caught.value.code == "payload.too_large"


class _SurrogateAfterCheck(_Changes):
    """Builds its Effect with dispatcher_effect(), then puts a lone surrogate in its payload."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["n"] > 0:
            return self.second(state, window)
        effect = dispatcher_effect({"charge": 1})
        effect.payload["note"] = "cite \ud800 sources"  # type: ignore[index]
        return Step(0, Continue((effect,)), {"n": 1})


def test_a_payload_given_a_lone_surrogate_after_its_check_is_refused_as_invalid_and_nothing_is_stored(
    tmp_path: Path,
) -> None:
    """codec.PydanticMapper.encode: an event orjson cannot encode (a payload changed in place
    after dispatcher_effect() checked it) is ``payload.invalid`` naming its position, and nothing
    is stored. Mutant: the encoder's TypeError was not caught: ``Runtime.start`` raised a bare
    TypeError ("str is not valid UTF-8") from inside the store."""
    program = _program("mistake.surrogate", _raise(ValueError()), CallLog(tmp_path / "c"),
                       strategy=_SurrogateAfterCheck("changed in place"))
    store = EventStore(f"sqlite:///{tmp_path / 'encode.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as caught:
                runtime.start(program, {}, start_id="surrogate")
            assert caught.value.code == "payload.invalid"
            assert "cannot be encoded" in caught.value.message and "nothing was stored" in caught.value.message
            assert store.heads() == []
    finally:
        store.close()

