"""A tool's input request whose response schema uses local ``$ref``s can be answered (found by a
review: scenarios.md accepts such a schema, and its wait opened, but every answer was refused
with `schema.invalid: unresolvable $ref`, and once schemas were checked when a wait opens, the
tool call failed: the answer's schema wraps the tool's under ``properties.input_response``,
which moved the root its refs resolve against)."""

from __future__ import annotations

from agentfold.domain.interaction.tool_call import input_response_schema
from agentfold.domain.json_schema import check_schema, schema_errors

ANSWER = {
    "$defs": {"Answer": {"type": "object", "required": ["approved"], "properties": {"approved": {"type": "boolean"}}}},
    "$ref": "#/$defs/Answer",
}


def test_a_response_schema_with_local_refs_checks_answers_once_wrapped() -> None:
    wrapped = input_response_schema(ANSWER)
    check_schema(wrapped, "#response_schema")  # resolvable: a wait with it opens
    assert schema_errors({"input_response": {"approved": True}}, wrapped) == []
    assert schema_errors({"input_response": {"approved": "yes"}}, wrapped) == [
        "$.input_response.approved: expected boolean, got string"]


def test_refs_inside_data_keywords_and_recursive_refs_are_kept_as_they_mean() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        "tag": {"const": {"$ref": "#/not/a/reference"}}}}}, "$ref": "#"}
    wrapped = input_response_schema({"anyOf": [{"$ref": "#/$defs/node"}], "$defs": tree["$defs"]})
    check_schema(wrapped)
    inner = wrapped["properties"]["input_response"]  # type: ignore[index]
    assert inner["anyOf"][0]["$ref"] == "#/properties/input_response/$defs/node"
    assert inner["$defs"]["node"]["properties"]["tag"]["const"] == {"$ref": "#/not/a/reference"}
    good = {"input_response": {"kids": [{"kids": [], "tag": {"$ref": "#/not/a/reference"}}]}}
    assert schema_errors(good, wrapped) == []


def test_a_property_named_like_a_data_keyword_keeps_its_refs_moved() -> None:
    # A property called "default" (or const, enum, examples) was taken for the keyword: its
    # $ref was left pointing at the wrapper, and the tool call failed when its wait opened.
    level = {"$defs": {"Level": {"enum": ["low", "high"]}},
             "type": "object", "properties": {"default": {"$ref": "#/$defs/Level"}, "const": {"$ref": "#/$defs/Level"}}}
    wrapped = input_response_schema(level)
    check_schema(wrapped)
    assert schema_errors({"input_response": {"default": "low", "const": "high"}}, wrapped) == []
    assert schema_errors({"input_response": {"default": "medium"}}, wrapped) != []
