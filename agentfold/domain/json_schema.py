"""A small, pure JSON Schema validator (the subset agentfold's contracts use).

Supported keywords: ``type`` (string or list), ``enum``, ``const``, ``properties``,
``required``, ``additionalProperties``, ``patternProperties``, ``minProperties``,
``maxProperties``, ``items``, ``prefixItems``, ``minItems``, ``maxItems``,
``uniqueItems``, ``minLength``, ``maxLength``, ``pattern``, ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``, ``allOf``, ``anyOf``,
``oneOf``, ``not``, ``if``/``then``/``else`` and local ``$ref`` (``#/...``, including
``$defs`` and ``definitions``). Annotation keywords (``title``, ``description``,
``default``, ``examples``, ``format``, ``$schema``, ``$id``) are accepted and ignored.
Any other keyword is refused when the schema is checked, so a schema never
silently means less than its author wrote. ``pattern`` and ``patternProperties`` keys are
ECMA-262 regular expressions searched unanchored (``ecma_regex``: ``$``, ``.``, ``\\d``,
``\\w``, ``\\s`` as ECMA-262 reads them); ``multipleOf`` is exact on the numbers as written.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Context, Decimal
from typing import Any

from agentfold.domain.canonical import MAX_DEPTH, normalize
from agentfold.domain.errors import InvalidInput

_ANNOTATIONS = {
    "title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding",
}
_KEYWORDS = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "uniqueItems",
    "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$defs", "definitions",
}
_TYPES = {"null", "boolean", "object", "array", "number", "integer", "string"}
#: Python frames one check may nest (a step into a subschema costs one, a ``$ref`` two): room
#: for a value as deep as a payload may be (MAX_DEPTH levels) under a schema recursing through
#: ``items`` or ``properties`` and a ``$ref`` (three a level), well under the interpreter's
#: recursion limit. It was 64 steps: such a value 22 levels deep was refused.
MAX_STEPS = 3 * MAX_DEPTH + 16


class SchemaError(InvalidInput):
    """A value does not satisfy a schema, or a schema is not one we can enforce."""


# ECMA-262 WhiteSpace and LineTerminator: what its \s matches (Python's differs: \x1c-\x1f in, \ufeff out).
_ECMA_SPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"


@functools.lru_cache(maxsize=1024)
def ecma_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` (an ECMA-262 regular expression, as JSON Schema says) compiled to mean in
    Python's ``re`` what it means in ECMA-262 where the two differ on a valid value: ``$`` is
    the end of the string (Python's also matches before a final newline: ``^[a-z]+$`` took
    "main\\n"), ``.`` no line terminator, ``\\d`` ``\\w`` ``\\b`` ASCII (``re.ASCII``; Python's
    take any Unicode digit or letter), ``\\s`` ECMA's white space, ``[]`` nothing and ``[^]``
    anything. Python-only syntax (``(?P<n>...)``, ``\\Z``) is still read as Python reads it;
    a pattern ``re`` cannot compile (``\\p{L}``) raises ``re.error``."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            escaped = pattern[i + 1]
            if escaped == "s":
                out.append(_ECMA_SPACE if in_class else f"[{_ECMA_SPACE}]")
            elif escaped == "S" and not in_class:
                out.append(f"[^{_ECMA_SPACE}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            negated = pattern.startswith("[^", i)
            start = i + (2 if negated else 1)
            if pattern.startswith("]", start):  # ECMA: [] matches nothing, [^] any character
                out.append("[\\s\\S]" if negated else "(?!)")
                i = start + 1
                continue
            out.append(pattern[i:start])
            i, in_class = start, True
            continue
        elif c == "$":
            c = "\\Z"
        elif c == ".":
            c = "[^\\n\\r\\u2028\\u2029]"
        out.append(c)
        i += 1
    try:
        return re.compile("".join(out), re.ASCII)
    except (ValueError, OverflowError, RecursionError) as exc:
        # "(?u)" against re.ASCII, "a{99999999999999999999}", 2000 nested groups: not a crash
        # of check_schema but a pattern we cannot enforce.
        raise re.error(f"{type(exc).__name__}: {exc}") from None


def _type_ok(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return False


def _equal(a: Any, b: Any) -> bool:
    # JSON equality: 1 == 1.0, but True != 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def check_schema(schema: Any, path: str = "#") -> None:
    """Refuse a schema that is malformed, is no JSON (a ``const`` of bytes, an ``enum`` holding
    a set or NaN: nothing could ever match it), uses keywords this validator does not enforce,
    or holds a local ``$ref`` that names no schema in it (refused here, not at the first value
    checked against it)."""
    try:
        normalize(schema, what="schema")
    except InvalidInput as exc:
        raise SchemaError("schema.invalid", f"the schema at {path} is not JSON: {exc.message}") from None
    _check_schema(schema, path, schema, set())
    _check_no_loop(schema, path)


# Keywords whose value is one schema, a list of schemas, or an object of schemas.
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
#: Keywords whose value maps names to schemas (a property may be called "default" or "const").
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords that apply their schema to the same value: a cycle through them never ends.
_IN_PLACE = ("$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _subschemas(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in _ONE_SCHEMA:
        if key in schema:
            out.append((key, schema[key]))
    for key in _SCHEMA_LISTS:
        out += [(f"{key}/{i}", sub) for i, sub in enumerate(schema.get(key, []))]
    for key in SCHEMA_MAPS:
        out += [(f"{key}/{name}", sub) for name, sub in schema.get(key, {}).items()]
    return out


def _check_no_loop(schema: Any, path: str) -> None:
    """Refuse a schema that applies itself to the same value without end (``{"$ref": "#"}``,
    ``{"anyOf": [{"$ref": "#"}, ...]}``): checking any value against it would never finish
    (each level multiplies the work). Refs are resolvable here (``_check_schema`` ran)."""

    def in_place(node: dict[str, Any], where: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [(f"{where}/{k}", v) for k, v in _subschemas(node) if k.split("/")[0] in _IN_PLACE]
        if "$ref" in node:
            out.append((node["$ref"], resolve_ref(schema, node["$ref"])))
        return out

    done: set[int] = set()

    def visit(node: Any, where: str, active: set[int]) -> None:
        # A depth-first search over in-place edges: a node met again on the current path is a loop.
        if not isinstance(node, dict) or id(node) in done:
            return
        if id(node) in active:
            raise SchemaError("schema.invalid", f"the schema at {where} refers to itself without end "
                              "(through $ref, allOf, ...)")
        active.add(id(node))
        for sub_where, sub in in_place(node, where):
            visit(sub, sub_where, active)
        active.discard(id(node))
        done.add(id(node))

    pending: list[tuple[str, Any]] = [(path, schema)]
    while pending:
        where, node = pending.pop()
        if isinstance(node, dict):
            visit(node, where, set())
            pending += [(f"{where}/{key}", sub) for key, sub in _subschemas(node)]


def _check_schema(schema: Any, path: str, root: Any, refs: set[str]) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaError("schema.invalid", f"schema at {path} must be an object or a boolean")
    for key, sub in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _KEYWORDS:
            raise SchemaError("schema.invalid", f"unsupported schema keyword {key!r} at {path}")
        where = f"{path}/{key}"
        if key == "type":
            names = sub if isinstance(sub, list) else [sub]
            # isinstance first: {"type": [{}]} raised a bare TypeError (an unhashable name).
            if not names or any(not isinstance(n, str) or n not in _TYPES for n in names):
                raise SchemaError("schema.invalid", f"invalid type {sub!r} at {where}")
        elif key in ("properties", "patternProperties", "$defs", "definitions"):
            if not isinstance(sub, dict):
                raise SchemaError("schema.invalid", f"{key} at {path} must be an object")
            for name, child in sub.items():
                if key == "patternProperties":
                    try:
                        ecma_regex(name)
                    except re.error as exc:
                        raise SchemaError("schema.invalid", f"bad pattern {name!r} at {where}") from exc
                _check_schema(child, f"{where}/{name}", root, refs)
        elif key in ("additionalProperties", "items", "not", "if", "then", "else"):
            _check_schema(sub, where, root, refs)
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if not isinstance(sub, list) or not sub:
                raise SchemaError("schema.invalid", f"{key} at {path} must be a non-empty array")
            for i, child in enumerate(sub):
                _check_schema(child, f"{where}/{i}", root, refs)
        elif key == "required":
            if not isinstance(sub, list) or not all(isinstance(n, str) for n in sub):
                raise SchemaError("schema.invalid", f"required at {path} must be an array of strings")
        elif key == "enum":
            if not isinstance(sub, list):
                raise SchemaError("schema.invalid", f"enum at {path} must be an array")
        elif key == "pattern":
            try:
                if not isinstance(sub, str):
                    raise TypeError(type(sub).__name__)
                ecma_regex(sub)
            except (re.error, TypeError) as exc:
                raise SchemaError("schema.invalid", f"bad pattern {sub!r} at {path}") from exc
        elif key in ("minProperties", "maxProperties", "minItems", "maxItems", "minLength", "maxLength"):
            # 2.0 is an integer in JSON Schema (and so a valid count); 2.5 is not.
            integral = isinstance(sub, int) or (isinstance(sub, float) and sub.is_integer())
            if not integral or isinstance(sub, bool) or sub < 0:
                raise SchemaError("schema.invalid", f"{key} at {path} must be a non-negative integer")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if not isinstance(sub, (int, float)) or isinstance(sub, bool):
                raise SchemaError("schema.invalid", f"{key} at {path} must be a number")
            if key == "multipleOf" and sub <= 0:
                raise SchemaError("schema.invalid", f"multipleOf at {path} must be positive")
        elif key == "uniqueItems":
            if not isinstance(sub, bool):
                raise SchemaError("schema.invalid", f"uniqueItems at {path} must be a boolean")
        elif key == "$ref":
            if not isinstance(sub, str) or not sub.startswith("#"):
                raise SchemaError("schema.invalid", f"only local $ref is supported, got {sub!r} at {path}")
            if sub not in refs:  # each target once: a recursive schema refers to itself
                refs.add(sub)
                try:
                    target = resolve_ref(root, sub)
                except SchemaError:
                    raise SchemaError("schema.invalid", f"unresolvable $ref {sub!r} at {path} "
                                      "(a $ref names a schema in this one: #/$defs/...)") from None
                if not isinstance(target, (dict, bool)):
                    raise SchemaError("schema.invalid", f"$ref {sub!r} at {path} does not name a schema "
                                      f"(it names a {type(target).__name__})")
                _check_schema(target, sub, root, refs)


_PERCENT = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _unquote(text: str) -> str:
    """A URI fragment percent-decoded as UTF-8 (``UnicodeDecodeError`` for bytes that are no
    UTF-8: ``%ff``); a ``%`` not followed by two hex digits stays as it is."""
    return _PERCENT.sub(lambda m: bytes.fromhex(m.group(0).replace("%", "")).decode("utf-8"), text)


def resolve_ref(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` names inside ``root`` (``schema.invalid`` when it names nothing)."""
    node = root
    if ref in ("#", "#/"):
        return node
    # The fragment of a URI: percent-encoded ("#/$defs/a%20b" names "a b"), then a JSON
    # pointer whose steps also index arrays ("#/allOf/0", "#/prefixItems/1").
    try:
        pointer = _unquote(ref[2:])
    except UnicodeDecodeError:  # "%ff": no UTF-8 text
        raise SchemaError("schema.invalid", f"unresolvable $ref {ref!r}") from None
    for part in pointer.split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and re.fullmatch(r"0|[1-9][0-9]*", part) and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError("schema.invalid", f"unresolvable $ref {ref!r}")
    return node


def _referred(value: Any, target: Any, root: Any, path: str, depth: int,
              memo: dict[tuple[int, int, str, int], list[str]]) -> list[str]:
    """The problems of ``value`` against the schema a ``$ref`` names, each (target, value, path,
    depth) checked once per ``schema_errors`` call: refs that reach one schema along many paths
    (a DAG: anyOf of two refs to the next level) took time exponential in its depth. Only refs
    can share a subschema, so only they are remembered (a check without refs pays nothing)."""
    key = (id(target), id(value), path, depth)
    found = memo.get(key)
    if found is None:
        found = memo[key] = _errors(value, target, root, path, depth, memo)
    return list(found)


def _errors(value: Any, schema: Any, root: Any, path: str, depth: int,
            memo: dict[tuple[int, int, str, int], list[str]]) -> list[str]:
    if depth > MAX_STEPS:
        return [f"{path}: schema nesting too deep"]
    if schema is True:
        return []
    if schema is False:
        return [f"{path}: no value is allowed here"]
    out: list[str] = []
    if "$ref" in schema:
        # Two frames (_referred, then _errors): two steps of the budget.
        out += _referred(value, resolve_ref(root, schema["$ref"]), root, path, depth + 2, memo)
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, n) for n in names):
            return [*out, f"{path}: expected {' or '.join(names)}, got {_json_type(value)}"]
    if "enum" in schema and not any(_equal(value, option) for option in schema["enum"]):
        out.append(f"{path}: value is not one of {schema['enum']!r}")
    if "const" in schema and not _equal(value, schema["const"]):
        out.append(f"{path}: value must equal {schema['const']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                out.append(f"{path}: missing required property {name!r}")
        patterns = schema.get("patternProperties", {})
        for name, item in value.items():
            matched = False
            if name in props:
                matched = True
                out += _errors(item, props[name], root, f"{path}.{name}", depth + 1, memo)
            for pattern, sub in patterns.items():
                if _search(pattern, name, memo):
                    matched = True
                    out += _errors(item, sub, root, f"{path}.{name}", depth + 1, memo)
            if not matched and "additionalProperties" in schema:
                extra = schema["additionalProperties"]
                if extra is False:
                    out.append(f"{path}: unexpected property {name!r}")
                else:
                    out += _errors(item, extra, root, f"{path}.{name}", depth + 1, memo)
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            out.append(f"{path}: fewer than {schema['minProperties']} properties")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            out.append(f"{path}: more than {schema['maxProperties']} properties")
    if isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            if i < len(prefix):
                out += _errors(item, prefix[i], root, f"{path}[{i}]", depth + 1, memo)
            elif "items" in schema:
                out += _errors(item, schema["items"], root, f"{path}[{i}]", depth + 1, memo)
        if "minItems" in schema and len(value) < schema["minItems"]:
            out.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: more than {schema['maxItems']} items")
        if schema.get("uniqueItems"):
            for i in range(len(value)):
                if any(_equal(value[i], value[j]) for j in range(i)):
                    out.append(f"{path}: items are not unique")
                    break
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            out.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: longer than {schema['maxLength']} characters")
        if "pattern" in schema and not _search(schema["pattern"], value, memo):
            out.append(f"{path}: does not match pattern {schema['pattern']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: less than minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: greater than maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            out.append(f"{path}: not greater than {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            out.append(f"{path}: not less than {schema['exclusiveMaximum']}")
        if "multipleOf" in schema and not (
            _was_multiple(value, schema["multipleOf"]) if type(memo) is _Releases else _is_multiple(value, schema["multipleOf"])
        ):
            out.append(f"{path}: not a multiple of {schema['multipleOf']}")
    for sub in schema.get("allOf", []):
        out += _errors(value, sub, root, path, depth + 1, memo)
    # Plain loops, no generator: each nested step costs one frame of the MAX_STEPS budget.
    if "anyOf" in schema:
        for sub in schema["anyOf"]:
            if not _errors(value, sub, root, path, depth + 1, memo):
                break
        else:
            out.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema:
        matches = 0
        for sub in schema["oneOf"]:
            if not _errors(value, sub, root, path, depth + 1, memo):
                matches += 1
        if matches != 1:
            out.append(f"{path}: matches {matches} of oneOf, expected exactly 1")
    if "not" in schema and not _errors(value, schema["not"], root, path, depth + 1, memo):
        out.append(f"{path}: must not match the 'not' schema")
    if "if" in schema:
        if not _errors(value, schema["if"], root, path, depth + 1, memo):
            if "then" in schema:
                out += _errors(value, schema["then"], root, path, depth + 1, memo)
        elif "else" in schema:
            out += _errors(value, schema["else"], root, path, depth + 1, memo)
    return out


# Precision for an exact remainder: a quotient below a float's range (1.8e308; larger ones are
# refused first) of numbers with at most 17 significant digits has at most ~650 digits.
_EXACT = Context(prec=1000)


def _exact(number: int | float) -> Decimal:
    # A float as the JSON text that gave it (its shortest repr: 0.1 is 1/10, not the binary
    # 0.1000000000000000055...), so 0.3 is a multiple of 0.1 as written.
    return Decimal(number) if isinstance(number, int) else Decimal(repr(number))


def _is_multiple(value: int | float, step: int | float) -> bool:
    """Exact: a float quotient with a tolerance took an odd 64-bit integer for a multiple of
    2 (2**60 + 1 divided by 2 rounds to an integer float), 1e17 for a multiple of 3 and
    0.30000000001 for a multiple of 0.1."""
    if isinstance(value, int) and isinstance(step, int):
        return value % step == 0
    try:
        # Kept from before: a quotient beyond a float (1e308 / 0.01) is no multiple
        # (tests/test_user_program_mistakes.py holds it).
        if not math.isfinite(value / step):
            return False
    except OverflowError:
        return False
    return _EXACT.remainder(_exact(value), _exact(step)).is_zero()


class _Releases(dict[tuple[int, int, str, int], list[str]]):
    """The memo of a check under the semantics of releases before 2026-12-05 (``pattern`` as
    Python's ``re.search``, ``multipleOf`` a float quotient within 1e-9): see
    ``recorded_schema_errors``."""


def _search(pattern: str, text: str, memo: dict[tuple[int, int, str, int], list[str]]) -> bool:
    if type(memo) is not _Releases:
        return ecma_regex(pattern).search(text) is not None
    try:
        return re.search(pattern, text) is not None
    except re.error:  # a pattern only ECMA-262 reads ("[^]"): no earlier release accepted its schema
        return False


def _was_multiple(value: int | float, step: int | float) -> bool:
    try:
        q = value / step
        return math.isfinite(q) and abs(q - round(q)) <= 1e-9
    except OverflowError:  # a quotient beyond a float (1e308 / 0.01): round() raised
        return False


def recorded_schema_errors(value: Any, schema: Any) -> list[str]:
    """``schema_errors`` for a value a history holds (the fold checks a Process's input, output
    and admitted signals again): none when a release before 2026-12-05 accepted it.

    That release read ``pattern`` as Python's ``re.search`` (``$`` matched before a final
    newline, ``\\d`` and ``\\w`` any Unicode digit or letter) and ``multipleOf`` with a float
    tolerance; values it admitted under those meanings stay readable, while every value
    admitted from now on is checked as JSON Schema says."""
    problems = schema_errors(value, schema)
    if problems and not _errors(value, schema, schema, "$", 0, _Releases()):
        return []
    return problems


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def accepts_nothing(schema: Any) -> bool:
    """Whether ``schema`` plainly accepts no value at all: ``false``, ``{"not": {}}`` or
    ``{"not": true}``, an empty ``enum``, bounds that contradict each other for the one type
    it allows (``minLength`` above ``maxLength``, ``minimum`` above ``maximum``, ...), or such
    a schema under ``allOf``, or only such schemas under ``anyOf`` / ``oneOf``. Not every
    unsatisfiable schema (that cannot be told in general): the ones written by mistake. A wait
    for an answer to one could only be canceled."""
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return False
    negated = schema.get("not")
    if negated is True or (isinstance(negated, dict) and not negated):
        return True
    if isinstance(schema.get("enum"), list) and not schema["enum"]:
        return True
    if any(accepts_nothing(sub) for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list)):
        return True
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list) and subs and all(accepts_nothing(sub) for sub in subs):
            return True
    kind = schema.get("type")
    bounds = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
              "object": ("minProperties", "maxProperties"), "number": ("minimum", "maximum"),
              "integer": ("minimum", "maximum")}.get(kind if isinstance(kind, str) else "")
    if bounds is not None:
        low, high = schema.get(bounds[0]), schema.get(bounds[1])
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
            return True
    return False


def schema_errors(value: Any, schema: Any) -> list[str]:
    """Every violation of ``schema`` by ``value``, as ``$.path: reason`` lines."""
    return _errors(value, schema, schema, "$", 0, {})


def validate(value: Any, schema: Any, *, code: str = "schema.violation", what: str = "value") -> None:
    """Raise a classified error naming the first violations, or return quietly."""
    problems = schema_errors(value, schema)
    if problems:
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise SchemaError(code, f"{what} does not satisfy its schema: {shown}", hint="fix the value to match the schema")
