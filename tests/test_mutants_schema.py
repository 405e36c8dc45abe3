"""JSON Schema keywords a mutation audit (2026-12-06, "schema") found undefended: each test
failed with its mutant planted in agentfold/domain/json_schema.py and passes without it.

Users meet the validator where a value is refused (docs/interaction.md, docs/python.md): a
model's tool call whose arguments break the tool's ``parameters`` is never run and the model
reads an ``error: invalid arguments: ...`` naming the value; an answer to an input request
that breaks its ``response_schema`` is refused with ``engine.signal.schema`` and the run keeps
waiting. The keywords below were ignored or misread by a planted bug without any test failing:

- a boolean is no ``integer`` (while 2.0 is one), no member of ``enum: [0, 1]`` and not equal
  to ``const: 1`` (``true`` is not 1);
- ``exclusiveMinimum`` / ``exclusiveMaximum`` refuse the bound itself;
- ``prefixItems`` checks the positions it describes, and ``items`` only those after them;
- ``patternProperties`` applies its schema to the names it matches, ``additionalProperties``
  (a schema) to the others; ``minProperties`` / ``maxProperties`` bound an object;
- ``maxItems`` bounds an array; ``allOf`` applies every one of its schemas; ``uniqueItems`` compares as JSON (1 and
  ``true`` are distinct);
- ``oneOf`` refuses a value matching two of its schemas; ``not`` refuses what its schema
  matches; ``if``/``then``/``else`` apply ``else`` only when ``if`` fails;
- a schema the validator cannot honour (``required`` or ``enum`` that is no array, a bound
  that is no number, ``multipleOf: 0``, an empty ``anyOf`` / ``oneOf``) is refused where it is
  written (a Descriptor: ``schema.invalid``; a scenario: ``agentfold run`` exits 2 with
  ``scenario.invalid`` naming each path), and a response schema asking for an integer at
  least 5 and at most 1 is one that accepts no answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import InvalidInput
from tests.interaction.tools import RecordingTool, call, chat_input, final, one_tool_round, tool_round

WAIT = 30.0

# ---------------------------------------------------------------------------
# A model's tool call: each refused call breaks one keyword, each accepted call sits at its edge

SETTINGS: JSON = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "retries": {"type": "integer"},
        "level": {"enum": [0, 1, 2]},
        "version": {"const": 1},
        "temperature": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2},
        # A labelled row: the first item names it, every later one is a count.
        "row": {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
        # Either a whole number of seconds or a duration text, never something that is both.
        "timeout": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 10}]},
        "role": {"type": "string", "not": {"enum": ["admin"]}},
        # Variables: upper-case names hold text, any other name a number; one to three of them.
        "env": {"type": "object", "patternProperties": {"^[A-Z_]+$": {"type": "string"}},
                "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 3},
        "port": {"allOf": [{"type": "integer"}, {"minimum": 1024}]},
        # Distinct as JSON: 1, true and "1" are three values.
        "tags": {"type": "array", "uniqueItems": True, "maxItems": 5},
        # A mode "file" needs a path; any other mode must not carry one.
        "output": {
            "type": "object",
            "if": {"properties": {"mode": {"const": "file"}}, "required": ["mode"]},
            "then": {"required": ["path"]},
            "else": {"not": {"required": ["path"]}},
        },
    },
}

# (call id, arguments, what the error the model reads must say)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("retries-true", {"retries": True}, "$.retries: expected integer, got boolean"),
    ("level-true", {"level": True}, "$.level: value is not one of"),
    ("level-false", {"level": False}, "$.level: value is not one of"),
    ("version-true", {"version": True}, "$.version: value must equal 1"),
    ("temperature-low", {"temperature": 0}, "$.temperature: not greater than 0"),
    ("temperature-high", {"temperature": 2}, "$.temperature: not less than 2"),
    ("row-label-counted", {"row": ["a", "b"]}, "$.row[1]: expected integer"),
    ("row-unlabelled", {"row": [1, 2]}, "$.row[0]: expected string"),
    ("env-named-number", {"env": {"HOME": 1}}, "$.env.HOME: expected string"),
    ("env-other-text", {"env": {"depth": "2"}}, "$.env.depth: expected integer"),
    ("env-empty", {"env": {}}, "$.env: fewer than 1 properties"),
    ("env-many", {"env": {"A": "1", "B": "2", "C": "3", "D": "4"}}, "$.env: more than 3 properties"),
    ("timeout-both", {"timeout": 12}, "$.timeout: matches 2 of oneOf"),
    ("role-admin", {"role": "admin"}, "$.role: must not match the 'not' schema"),
    ("port-low", {"port": 80}, "$.port: less than minimum 1024"),
    ("port-text", {"port": "8080"}, "$.port: expected integer"),
    ("tags-twice", {"tags": ["a", {"k": 1}, {"k": 1}]}, "$.tags: items are not unique"),
    ("tags-many", {"tags": [1, 2, 3, 4, 5, 6]}, "$.tags: more than 5 items"),
    ("file-without-path", {"output": {"mode": "file"}}, "$.output: missing required property 'path'"),
    ("screen-with-path", {"output": {"mode": "screen", "path": "/tmp/x"}}, "$.output: must not match"),
]

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("edges", {"retries": 0, "level": 1, "version": 1.0, "temperature": 0.001, "row": ["a", 1, 2],
               "timeout": 3, "role": "viewer", "output": {"mode": "file", "path": "/tmp/x"}, "port": 1024,
               "env": {"HOME": "/root", "depth": 2}, "tags": [1, True, "1", {"k": 1}, {"k": True}]}),
    ("other-edges", {"retries": 2.0, "level": 0, "temperature": 1.999, "row": ["b"], "timeout": 10.5, "output": {"mode": "screen"}}),
]


def test_a_tool_call_misreading_a_keyword_never_runs_and_the_model_is_told_which_value() -> None:
    tool = RecordingTool("configure", SETTINGS, "applied")
    results = one_tool_round(tool, [(cid, args) for cid, args, _ in REFUSED] + ACCEPTED)

    # Only the calls at the edges ran, with exactly their arguments.
    def by_retries(arguments: Any) -> str:
        return str(arguments.get("retries"))

    assert sorted(tool.ran, key=by_retries) == sorted([args for _, args in ACCEPTED], key=by_retries)
    for cid, _, said in REFUSED:
        text, is_error = results[cid]
        assert is_error and text.startswith("error: invalid arguments: ") and said in text, (cid, text)
    for cid, _ in ACCEPTED:
        assert results[cid] == ("applied", False), (cid, results[cid])


# ---------------------------------------------------------------------------
# An answer to a tool's input request, refused with engine.signal.schema


APPROVAL: JSON = {
    "type": "object",
    "required": ["approved", "copies"],
    "additionalProperties": False,
    "properties": {
        "approved": {"type": "boolean"},
        "copies": {"type": "integer", "exclusiveMinimum": 0},
        "tier": {"enum": [1, 2]},
        "note": {"not": {"type": "null"}},
    },
}


class Approve:
    name = "approve"
    description = "Asks a human to approve the print job."
    parameters: JSON = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        if invocation.continuation is None:
            raise ToolInputRequired({"question": "print it?"}, APPROVAL, None)
        return ToolOutput.text(f"answer: {invocation.continuation.response}")


@pytest.mark.parametrize(("answer", "said"), [
    ({"approved": 1, "copies": 2}, "$.approved: expected boolean, got number"),
    ({"approved": True, "copies": True}, "$.copies: expected integer, got boolean"),
    ({"approved": True, "copies": 0}, "$.copies: not greater than 0"),
    ({"approved": True, "copies": 1, "tier": True}, "$.tier: value is not one of"),
    ({"approved": True, "copies": 1, "note": None}, "$.note: must not match the 'not' schema"),
])
def test_an_answer_breaking_its_response_schema_is_refused_and_the_request_stays_open(
    tmp_path: Path, answer: JSON, said: str
) -> None:
    model = ScriptedModel([tool_round(call("a", "approve", {})), final("done")])
    program = compile_interaction(InteractionConfig(name="schema.approve", model=model, tools=[Approve()]))
    store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, chat_input("print"), start_id="approve")
            runtime.wait_idle(run.tree_id)
            host = Host(runtime)
            [pending] = host.pending("approve")
            with pytest.raises(InvalidInput) as refused:
                host.answer(pending["process_id"], pending["wait_id"], answer)
            assert refused.value.code == "engine.signal.schema", refused.value
            assert said in refused.value.message, refused.value.message
            assert [p["wait_id"] for p in host.pending("approve")] == [pending["wait_id"]]
            # The answer the schema asks for is taken, and the run ends.
            assert host.answer(pending["process_id"], pending["wait_id"], {"approved": True, "copies": 1, "tier": 2})
            assert run.result(timeout=WAIT).status == "completed"
    finally:
        store.close()


# ---------------------------------------------------------------------------
# A schema the validator cannot honour is refused where it is written, not met at the first value

# (schema, the refusal's phrase): each was accepted by a planted bug, and then read a string as
# the list of its characters (required "name": "missing required property 'n'", enum "abc"
# took "a"), crashed the first check of a number (a bare TypeError or ZeroDivisionError), or
# accepted no value at all (an empty anyOf / oneOf).
CANNOT_HONOUR: list[tuple[JSON, str]] = [
    ({"type": "object", "required": "name"}, "required at # must be an array of strings"),
    ({"type": "object", "required": [1]}, "required at # must be an array of strings"),
    ({"type": "string", "enum": "abc"}, "enum at # must be an array"),
    ({"type": "number", "minimum": "5"}, "minimum at # must be a number"),
    ({"type": "number", "exclusiveMaximum": True}, "exclusiveMaximum at # must be a number"),
    ({"type": "integer", "multipleOf": 0}, "multipleOf at # must be positive"),
    ({"anyOf": []}, "anyOf at # must be a non-empty array"),
    ({"oneOf": []}, "oneOf at # must be a non-empty array"),
]


@pytest.mark.parametrize(("schema", "phrase"), CANNOT_HONOUR)
def test_a_descriptor_with_a_schema_the_validator_cannot_honour_is_refused_when_it_is_built(
    schema: JSON, phrase: str
) -> None:
    from agentfold.domain.program import Descriptor

    with pytest.raises(InvalidInput) as refused:
        Descriptor("schema.cannot_honour", input_schema=schema)
    assert refused.value.code == "schema.invalid", refused.value
    assert phrase.replace("at #", "at #input") in refused.value.message, refused.value.message


def test_a_scenario_whose_schemas_cannot_be_honoured_is_refused_by_run_with_every_path(tmp_path: Path) -> None:
    from tests.test_cli import agentfold, refused, sqlite_url

    tools = [{"name": f"t{i}", "parameters": schema, "result": {"output": "ok"}}
             for i, (schema, _) in enumerate(CANNOT_HONOUR)]
    # An integer at least 5 and at most 1: a wait for it could only be canceled.
    tools.append({"name": "ask", "result": {"input": {"prompt": "how many?", "response_schema":
                  {"type": "integer", "minimum": 5, "maximum": 1}}, "then": {"answer": True}}})
    path = tmp_path / "faulty.json"
    path.write_text(json.dumps({"name": "faulty", "tools": tools, "model": {
        "responses": [{"finish_reason": "stop", "message": {"content": "done"}}]}}))
    store = sqlite_url(tmp_path)
    error = refused(agentfold("run", str(path), "--json", store=store)).error()
    assert error["code"] == "scenario.invalid", error
    found = {f["path"]: f["message"] for f in error["detail"]["faults"]}
    expected = {f"$.tools[{i}].parameters": phrase for i, (_, phrase) in enumerate(CANNOT_HONOUR)}
    expected[f"$.tools[{len(CANNOT_HONOUR)}].result.input.response_schema"] = "accepts no answer"
    assert set(found) == set(expected), found
    for where, phrase in expected.items():
        assert phrase in found[where], (where, found[where])
    assert not (tmp_path / "agentfold.db").exists()  # refused before its store was created
