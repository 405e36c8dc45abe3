"""JSON Schema conformance of agentfold's validator, found by a differential audit against the
reference implementation (jsonschema's Draft 2020-12 validator, not a dependency: the cases
below are literal). Each case is one where our validator gave another answer than the spec:

- ``multipleOf`` was decided on a float quotient with a 1e-9 tolerance: an odd 64-bit integer
  passed ``{"multipleOf": 2}`` (the quotient rounds to an integer float), 1e17 passed
  ``{"multipleOf": 3}``, 0.30000000001 passed ``{"multipleOf": 0.1}``: a tool call with such
  an argument ran. It is now exact on the numbers as written (0.3 is a multiple of 0.1);
- ``{"type": [{}]}`` (or ``{"type": {}}``) crashed ``check_schema`` with a bare TypeError
  instead of a classified ``schema.invalid``;
- a local ``$ref`` is a JSON pointer in a URI fragment: ``#/allOf/0`` (an array index) and
  ``#/$defs/a%20b`` (percent-encoded) name schemas, and were refused as unresolvable (the
  docs promise "any ``#/...`` JSON pointer into the same schema");
- a count keyword written as an integral float (``{"minLength": 2.0}``) is a valid 2020-12
  schema (2.0 is an integer in JSON Schema) and was refused.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentfold.domain.interaction.toolset import prepare_arguments
from agentfold.domain.json_schema import SchemaError, check_schema, schema_errors


def _ok(value: Any, schema: Any) -> bool:
    check_schema(schema)
    return schema_errors(value, schema) == []


@pytest.mark.parametrize(("schema", "value"), [
    ({"multipleOf": 2}, 2**60 + 1),
    ({"multipleOf": 3}, 1e17),
    ({"multipleOf": 0.1}, 0.30000000001),
    ({"multipleOf": 7}, 9223372036854775807 - 1),
])
def test_a_number_that_is_not_a_multiple_is_refused_however_large(schema: Any, value: Any) -> None:
    assert not _ok(value, schema)


@pytest.mark.parametrize(("schema", "value"), [
    ({"multipleOf": 2}, 2**60 + 2),
    ({"multipleOf": 0.1}, 0.3),
    ({"multipleOf": 0.01}, 12.34),
    ({"multipleOf": 0.5}, 3),
    ({"multipleOf": 2.5}, 7.5),
    ({"multipleOf": 7}, 9223372036854775807),
])
def test_a_multiple_is_accepted_as_written(schema: Any, value: Any) -> None:
    assert _ok(value, schema)


def test_a_tool_call_with_an_odd_big_integer_for_an_even_parameter_never_reaches_the_tool() -> None:
    schema = {"type": "object", "properties": {"pairs": {"type": "integer", "multipleOf": 2}}}
    arguments, problem = prepare_arguments('{"pairs": 1152921504606846977}', schema)
    assert arguments is None and problem is not None and "not a multiple of 2" in problem
    assert prepare_arguments('{"pairs": 1152921504606846978}', schema) == ({"pairs": 1152921504606846978}, None)


@pytest.mark.parametrize("schema", [{"type": [{}]}, {"type": {}}, {"type": [["string"]]}])
def test_a_type_that_is_no_name_is_a_classified_schema_error_not_a_crash(schema: Any) -> None:
    with pytest.raises(SchemaError) as refused:
        check_schema(schema)
    assert refused.value.code == "schema.invalid"


@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"$defs": {"s": {"anyOf": [{"type": "string"}]}}, "properties": {"a": {"$ref": "#/$defs/s/anyOf/0"}}},
     {"a": "x"}, {"a": 1}),
    ({"prefixItems": [{"type": "string"}], "items": {"$ref": "#/prefixItems/0"}}, ["a", "b"], ["a", 1]),
    ({"$defs": {"a b": {"type": "string"}}, "$ref": "#/$defs/a%20b"}, "x", 1),
    ({"$defs": {"a%b": {"type": "string"}}, "$ref": "#/$defs/a%25b"}, "x", 1),
    ({"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"}, "x", 1),
])
def test_a_ref_is_any_json_pointer_into_the_schema_array_indices_and_percent_encoding_too(
    schema: Any, good: Any, bad: Any
) -> None:
    assert _ok(good, schema)
    assert not _ok(bad, schema)


@pytest.mark.parametrize("ref", ["#/allOf/1", "#/allOf/01", "#/allOf/-1", "#/$defs/a%2", "#/$defs/a b%20",
                                 "#/$defs/%ff"])
def test_a_ref_past_an_array_or_to_a_missing_name_is_still_refused(ref: str) -> None:
    with pytest.raises(SchemaError) as refused:
        check_schema({"allOf": [{"type": "string"}], "$defs": {"a": {}}, "properties": {"x": {"$ref": ref}}})
    assert refused.value.code == "schema.invalid"


def test_a_count_written_as_an_integral_float_is_a_valid_schema() -> None:
    schema = {"type": "string", "minLength": 2.0, "maxLength": 3.0}
    assert _ok("ab", schema) and not _ok("a", schema) and not _ok("abcd", schema)
    with pytest.raises(SchemaError):
        check_schema({"minLength": 2.5})


@pytest.mark.parametrize("value", [1e-10, -1.137679918339559e-202, 0.5])
def test_a_tiny_fraction_is_no_multiple_of_one(value: float) -> None:
    # The 1e-9 tolerance on the quotient took 1e-10 for a multiple of 1.
    assert not _ok(value, {"multipleOf": 1})
    assert not _ok(value, {"type": "integer"})


# ``pattern`` is an ECMA-262 regular expression (2020-12 validation 6.3.3), searched unanchored.
# Python's ``re`` differs where it hurts: ``$`` also matches before a final newline (an id
# pattern ``^[a-z0-9-]+$`` let "main\n" through to a tool), ``\d`` and ``\w`` take any Unicode
# digit or letter, ``.`` matches a carriage return.
@pytest.mark.parametrize(("pattern", "bad"), [
    ("^[a-z0-9-]+$", "main\n"),
    ("^abc$", "abc\n"),
    ("^\\d+$", "\u0661\u0662\u0663"),
    ("^\\d+$", "\uff11"),
    ("^\\w+$", "\u00e9t\u00e9"),
    ("^[\\w-]+$", "caf\u00e9"),
    ("^.$", "\r"),
    ("^.$", "\u2028"),
    ("^\\S+$", "a\u00a0b"),
])
def test_a_pattern_means_what_it_means_in_ecma_262(pattern: str, bad: str) -> None:
    assert not _ok(bad, {"type": "string", "pattern": pattern})
    assert not _ok({bad: 1}, {"type": "object", "patternProperties": {pattern: True}, "additionalProperties": False})


@pytest.mark.parametrize(("pattern", "good"), [
    ("^[a-z0-9-]+$", "main"),
    ("b$", "ab"),
    ("a", "xax"),  # unanchored: a search, not a match
    ("^\\d+$", "0123456789"),
    ("^\\w+$", "A_z9"),
    ("^.$", "\U0001f600"),  # one code point, not two UTF-16 units
    ("^\\s$", "\u00a0"),
    ("^\\s$", "\ufeff"),
    ("^[\\s]$", "\u3000"),
    ("^[$]$", "$"),
    ("^\\$$", "$"),
    ("^\\\\$", "\\"),
    ("^[^]$", "\n"),
    ("^[.]$", "."),
    ("^a$|^b$", "b"),
    ("^a\\b", "a\u00e9"),  # \u00e9 is no word character: a boundary follows the a
])
def test_a_pattern_still_accepts_what_ecma_262_accepts(pattern: str, good: str) -> None:
    assert _ok(good, {"type": "string", "pattern": pattern})
    assert _ok({good: 1}, {"type": "object", "patternProperties": {pattern: True}, "additionalProperties": False})


def test_an_empty_class_matches_nothing_as_in_ecma_262() -> None:
    assert not _ok("a", {"pattern": "[]"}) and not _ok("", {"pattern": "[]"})


@pytest.mark.parametrize("pattern", ["a{99999999999999999999}", "(" * 2000 + ")" * 2000, "(?u)a", "\\p{L}", "("])
def test_a_pattern_python_cannot_compile_is_a_classified_schema_error_not_a_crash(pattern: str) -> None:
    # a{99999999999999999999} raised a bare OverflowError, 2000 nested groups a RecursionError.
    for schema in ({"pattern": pattern}, {"patternProperties": {pattern: {}}}):
        with pytest.raises(SchemaError) as refused:
            check_schema(schema)
        assert refused.value.code == "schema.invalid"


def test_a_value_as_deep_as_a_payload_may_be_checks_against_a_recursive_schema() -> None:
    # The validator stopped after 64 schema steps: a list nested 33 levels deep was refused by
    # {"items": {"$ref": "#"}} ("schema nesting too deep"), a tree of anyOf [$ref, null] 22
    # levels deep ("matches none of anyOf"), though payloads may nest 128 levels.
    from agentfold.domain.canonical import MAX_DEPTH, normalize

    schema = {"type": "array", "items": {"$ref": "#"}}
    value: Any = []
    for _ in range(MAX_DEPTH - 1):
        value = [value]
    assert normalize(value) == value
    assert _ok(value, schema)
    assert not _ok([value, [[["x"]]]], {"type": "array", "items": {"$ref": "#"}})
    tree = {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "n": {"type": "integer"}}}
    node: Any = {"n": 0}
    for i in range(40):
        node = {"n": i, "c": node}
    assert _ok(node, tree)
    node["c"]["c"]["n"] = "x"
    assert not _ok(node, tree)


def test_a_ref_by_array_index_or_percent_encoding_to_itself_is_still_a_loop() -> None:
    for schema in ({"allOf": [{"$ref": "#/allOf/0"}]}, {"anyOf": [{"$ref": "#/anyOf/%30"}]},
                   {"$defs": {"a": {"$ref": "#/$defs/%61"}}, "$ref": "#/$defs/a"}):
        with pytest.raises(SchemaError, match="refers to itself without end"):
            check_schema(schema)


# ---------------------------------------------------------------------------
# Values a history holds, admitted by a release that read pattern and multipleOf as Python does


NAMED = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[a-z]+$"}, "n": {"type": "integer", "multipleOf": 2}}}


def test_a_value_an_earlier_release_admitted_stays_readable_while_a_new_one_is_refused() -> None:
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.runtime import Runtime
    from agentfold.domain.errors import InvalidInput
    from agentfold.domain.json_schema import recorded_schema_errors
    from agentfold.domain.program import Descriptor, Program
    from agentfold.domain.tree import fold_tree
    from tests.kernel_programs import IMPL, Asker, config_digest

    # A release before 2026-12-05 admitted both ("$" before a final newline; 2**60 + 1 / 2 as a
    # float quotient within 1e-9 of an integer); a history holding them must still fold.
    old = {"name": "main\n", "n": 2**60 + 1}
    assert schema_errors(old, NAMED) != [] and recorded_schema_errors(old, NAMED) == []
    assert recorded_schema_errors({"name": "Main"}, NAMED) != []  # refused by every release

    program = Program(Descriptor("test.named", input_schema=NAMED), Asker(), IMPL, config_digest("test.named"))
    store = EventStore("memory:")
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            with pytest.raises(InvalidInput):
                runtime.start(program, old, start_id="new")  # admitted from now on as JSON Schema says
            handle = runtime.start(program, {"name": "main"}, start_id="recorded")
            runtime.wait_idle(handle.tree_id, timeout=20)
            events = [r.event for r in store.read(handle.tree_id)]
    finally:
        store.close()
    as_recorded = [events[0].model_copy(update={"input": old}), *events[1:]]
    tree = fold_tree(as_recorded, Catalog([program]).resolve)
    assert tree.root.input == old
    with pytest.raises(Exception) as caught:  # a value no release admitted is still a broken rule
        fold_tree([events[0].model_copy(update={"input": {"name": "Main"}}), *events[1:]], Catalog([program]).resolve)
    assert getattr(caught.value, "rule", None) == "program.input", caught.value
