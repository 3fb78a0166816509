"""Structured outputs: `response_format` (OpenAI) and `structured_outputs` (vLLM) as one engine `Constraint`.

`output_constraint` is the one conversion from a request's output format (and its tools: tools.py) to the engine's
parameter, for any endpoint that takes these fields. Everything a client sends here is checked before it reaches
the grammar engine: a schema is a JSON object within MAX_SCHEMA_CHARS and MAX_SCHEMA_DEPTH that `jsonschema` accepts
as a schema of its draft; a regex, a grammar and the choices are bounded too. What the grammar engine itself
refuses (an unsatisfiable schema, a regex it cannot parse) is a ConstraintError when the request is prepared,
answered as a 400 naming the same field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from ..engines import Constraint
from ..engines.grammar import json_text

MAX_SCHEMA_CHARS = 65_536  # a schema's JSON text; OpenAI's own limits are of the same order
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a schema's JSON
MAX_PATTERN_CHARS = 8_192  # a regex or a grammar
MAX_CHOICES, MAX_CHOICE_CHARS = 1_024, 1_024
# How JSON is written under a constraint: json.dumps' separators, no free whitespace (a small model left free to
# add whitespace may never stop adding it). llguidance reads these options from the schema itself, so both engines
# build the same grammar from the same text.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# vLLM's structured_outputs keys this server takes; the older top-level guided_* fields mean the same
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's (and a json_schema's) name
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class FormatError(ValueError):
    """A bad output format: the 400's message and the parameter it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class OutputFormat:
    """An output constraint as the API took it: the engine's constraint and the request field it came from."""

    constraint: Constraint
    param: str


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema from a client, bounded and valid for its draft (2020-12 unless `$schema` names another)."""
    if not isinstance(schema, dict):
        raise FormatError(f"{param} must be a JSON schema object", param)
    if (depth := _depth(schema)) > MAX_SCHEMA_DEPTH:  # first: the checks below recurse through the schema
        raise FormatError(f"{param} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are taken", param)
    text = json_text(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise FormatError(f"{param} is {len(text)} characters of JSON; at most {MAX_SCHEMA_CHARS} are taken", param)
    if not isinstance(schema.get("$schema", ""), str):
        raise FormatError(f"{param}.$schema must be a string (a meta-schema's URI)", param)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise FormatError(
            f"{param} is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""), param
        ) from None
    return schema


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
)


def closed(schema: Any) -> Any:
    """The schema with every object that lists properties and says nothing of others taking no others (a copy).
    A constraint is always built so, as vLLM's default grammar backend (xgrammar's strict mode) builds it and as
    OpenAI's `strict` asks: a small model free to invent keys may never stop inventing them."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: ({n: closed(s) for n, s in v.items()} if k in _SUBSCHEMA_MAPS and isinstance(v, dict) else v)
        for k, v in schema.items()
    }
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = closed(out[k])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_constraint(schema: dict[str, Any]) -> Constraint:
    """A JSON schema as the engine takes it: its objects closed, written in JSON_STYLE."""
    return Constraint("json", json_text({**closed(schema), "x-guidance": JSON_STYLE}))


ANY_OBJECT: dict[str, Any] = {"type": "object"}


def response_format(value: Any) -> OutputFormat | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    p = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise FormatError(f"{p}.type must be one of text, json_object, json_schema", f"{p}.type")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return OutputFormat(json_constraint(ANY_OBJECT), p)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError(f"{p}.json_schema must be an object with a name and a schema", f"{p}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise FormatError(
            f"{p}.json_schema.name must be 1 to 64 letters, digits, underscores or dashes", f"{p}.json_schema.name"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(f"{p}.json_schema.strict must be a boolean", f"{p}.json_schema.strict")
    schema = spec.get("schema", ANY_OBJECT)  # OpenAI's schema is optional: any JSON object then
    schema = check_schema(schema, f"{p}.json_schema.schema")
    return OutputFormat(json_constraint(schema), f"{p}.json_schema.schema")  # closed, strict or not


def structured_outputs(value: Any, param: str = "structured_outputs") -> OutputFormat | None:
    """vLLM's `structured_outputs`: exactly one of json (a schema or its JSON text), regex, choice, grammar and
    json_object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError(f"{param} must be an object with one of {', '.join(STRUCTURED_KINDS)}", param)
    for key in value:
        if key not in STRUCTURED_KINDS:
            raise FormatError(
                f"{param}.{key} is not supported by this server (use one of {', '.join(STRUCTURED_KINDS)})",
                f"{param}.{key}",
            )
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise FormatError(f"{param} takes exactly one of {', '.join(STRUCTURED_KINDS)}; got {len(given)}", param)
    return _one(given[0], value[given[0]], f"{param}.{given[0]}")


def guided(body: dict[str, Any]) -> OutputFormat | None:
    """vLLM's older top-level guided_json, guided_regex, guided_choice and guided_grammar: the same as the
    structured_outputs field they became."""
    given = [k for k in GUIDED if body.get(k) is not None]
    if len(given) > 1:
        raise FormatError(f"give one of {', '.join(GUIDED)}; got {', '.join(given)}", given[1])
    return _one(GUIDED[given[0]], body[given[0]], given[0]) if given else None


def _one(kind: str, v: Any, at: str) -> OutputFormat:
    """One structured_outputs constraint of `kind`, given as `v` in the field `at`."""
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except (json.JSONDecodeError, RecursionError):
                raise FormatError(f"{at} is not valid JSON", at) from None
        return OutputFormat(json_constraint(check_schema(v, at)), at)
    if kind == "json_object":
        if v is not True:
            raise FormatError(f"{at} must be true if given", at)
        return OutputFormat(json_constraint(ANY_OBJECT), at)
    if kind == "choice":
        if not isinstance(v, list) or not v or len(v) > MAX_CHOICES or not all(isinstance(c, str) and c for c in v):
            raise FormatError(f"{at} must be a list of 1 to {MAX_CHOICES} non-empty strings", at)
        if any(len(c) > MAX_CHOICE_CHARS for c in v):
            raise FormatError(f"each of {at} must be at most {MAX_CHOICE_CHARS} characters", at)
        return OutputFormat(Constraint("choice", json_text(v)), at)
    if not isinstance(v, str) or not v.strip() or "\x00" in v:
        raise FormatError(f"{at} must be a non-empty string without NUL characters", at)
    if len(v) > MAX_PATTERN_CHARS:
        raise FormatError(f"{at} is {len(v)} characters; at most {MAX_PATTERN_CHARS} are taken", at)
    return OutputFormat(Constraint("regex" if kind == "regex" else "grammar", v), at)
