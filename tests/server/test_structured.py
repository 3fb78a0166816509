"""Output formats as the API takes them: response_format, structured_outputs and the older guided_* fields become one
engine constraint; every bad one is a 400 naming the field at fault."""

from __future__ import annotations

import json
from typing import Any

import pytest

from skillpool.server.chat.output import output_constraint
from skillpool.server.chat.protocol import ChatCompletionRequest
from skillpool.server.chat.structured import (
    JSON_STYLE,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    closed,
)
from skillpool.server.engines import Constraint
from skillpool.server.errors import APIError

USER = {"role": "user", "content": "hi"}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"model": "auto", "messages": [USER], **fields})


def error(**fields: Any) -> tuple[str, str | None]:
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert e.value.status == 400
    return e.value.message, e.value.param


def schema_of(c: Constraint | None) -> dict[str, Any]:
    assert c is not None and c.kind == "json"
    spec = json.loads(c.spec)
    assert spec.pop("x-guidance") == JSON_STYLE
    return spec


def test_json_object_and_json_schema_become_a_json_constraint() -> None:
    r = parse(response_format={"type": "json_object"})
    assert r.output is not None and schema_of(r.output.constraint) == {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": OBJ}}
    r = parse(response_format=fmt)
    assert r.output is not None and schema_of(r.output.constraint) == {**OBJ, "additionalProperties": False}
    assert r.output.param == "response_format.json_schema.schema"
    sp = r.to_sampling_params(room=10, default_max_tokens=5, vocab_size=49152)
    assert sp.constraint == r.output.constraint
    assert parse(response_format={"type": "text"}).output is None


@pytest.mark.parametrize("strict", [True, False, None])
def test_every_object_that_lists_properties_is_closed(strict: bool | None) -> None:
    nested = {"type": "object", "properties": {"b": OBJ, "c": {"type": "array", "items": OBJ}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested, "strict": strict}}
    got = schema_of(parse(response_format=fmt).output.constraint)  # type: ignore[union-attr]
    assert got == closed(nested)
    assert got["additionalProperties"] is False
    assert got["properties"]["b"]["additionalProperties"] is False
    assert got["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the client's schema is not changed
    open_one = {"type": "object", "properties": {}, "additionalProperties": True}
    assert closed(open_one) == open_one  # what a schema says of other properties stands


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes","no"]'),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar", 'start: "a" | "b"'),
        ({"guided_choice": ["yes", "no"]}, "choice", '["yes","no"]'),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ],
)
def test_vllm_fields_old_and_new_mean_the_same(fields: dict[str, Any], kind: str, spec: str) -> None:
    out = parse(**fields).output
    assert out is not None and out.constraint == Constraint(kind, spec)  # type: ignore[arg-type]


def test_json_is_taken_as_a_schema_or_its_text() -> None:
    for fields in ({"structured_outputs": {"json": OBJ}}, {"structured_outputs": {"json": json.dumps(OBJ)}}):
        assert schema_of(parse(**fields).output.constraint) == closed(OBJ)  # type: ignore[union-attr]
    assert schema_of(parse(guided_json=OBJ).output.constraint) == closed(OBJ)  # type: ignore[union-attr]
    assert schema_of(parse(structured_outputs={"json_object": True}).output.constraint) == {"type": "object"}  # type: ignore[union-attr]


def deep(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text, json_object"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "a name and a schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": OBJ}}},
            "response_format.json_schema.name",
            "letters, digits",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema.schema",
            "not a valid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep(40)}}},
            "response_format.json_schema.schema",
            f"at most {MAX_SCHEMA_DEPTH}",
        ),
        (
            {"structured_outputs": {"json": {"enum": ["x" * 1000] * 70}}},
            "structured_outputs.json",
            f"at most {MAX_SCHEMA_CHARS}",
        ),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": {"$schema": {}}}}, "structured_outputs.json", "$schema must be a string"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "1 to 1024 non-empty strings"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty string"),
        ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex", "NUL"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": 5}, "structured_outputs", "must be an object"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "give one of"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "both constrain the answer",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ],
)
def test_each_bad_format_names_its_field(fields: dict[str, Any], param: str, says: str) -> None:
    message, got = error(**fields)
    assert got == param and says in message, message


def test_the_conversion_is_one_function_another_endpoint_can_call() -> None:
    """What the Responses API's text.format maps to: the same constraint as chat's response_format."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJ, "strict": True}}
    out = output_constraint(fmt)
    assert out is not None and schema_of(out.constraint) == closed(OBJ)
    assert output_constraint() is None
