"""Structured outputs and tool calls through the API on the tiny LLaMA: the real app behind uvicorn, called with the
openai SDK, with `model` set to auto, a skill, a mix and the base. A random model writes nonsense, so every answer
that validates does so because the grammar made it."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import served
from tests.schema_family import schema_family
from tests.synthetic import random_skills, write_store

MODELS = ["auto", "skill-0000", "skill-0000=0.6,skill-0001=0.4", "base"]
USER = [{"role": "user", "content": "Describe a pet as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=8)


@pytest.fixture(scope="module")
def url(tiny_base, embedder, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("data")
    config = json.loads((tiny_base.path / "config.json").read_text())
    # skill-0000's keys from prompts like USER's: `auto` routes USER to it (a skill, not the base model)
    pets = [f"Describe a {pet} as JSON." for pet in ("pet", "cat", "dog", "fish", "bird", "horse", "rabbit", "mouse")]
    weather = [f"What is the weather like in {c}?" for c in ("Paris", "Oslo", "Rome", "Lima", "Cairo", "Tokyo")]

    def keys(router: Any, i: int) -> dict[str, Any]:
        return router.prepare_keys(pets if i == 0 else weather * 2)

    write_store(data, random_skills(config, 2, rank=4, alpha=8.0), model=tiny_base.path, keys=keys)
    c = build_components(ServerConfig.of(data_dir=data, default_max_tokens=400), base=tiny_base, embedder=embedder)
    with served(create_app(c)) as root:
        yield root
    c.close()


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def json_schema(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.mark.parametrize("model", MODELS)
def test_a_family_of_schemas_validates_on_every_route(client, model: str) -> None:  # type: ignore[no-untyped-def]
    schemas = schema_family(seed=7, n=6)

    def ask(schema: dict[str, Any]) -> tuple[Any, str | None]:
        r = client.chat.completions.create(
            model=model, messages=USER, response_format=json_schema(schema), max_tokens=400, temperature=0.7, seed=1
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(len(schemas)) as pool:  # constrained rows in one batch, each with its own grammar
        answers = list(pool.map(ask, schemas))
    for schema, (text, finish) in zip(schemas, answers):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_a_streamed_schema_answer_validates(client) -> None:  # type: ignore[no-untyped-def]
    schema = schema_family(seed=3, n=1)[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(
        model="skill-0001", messages=USER, response_format=json_schema(schema), stream=True, max_tokens=400
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("model", MODELS)
def test_parse_returns_the_pydantic_instance(client, model: str) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.parse(model=model, messages=USER, response_format=Pet, max_tokens=200)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and len(pet.name) <= 8


@pytest.mark.parametrize("model", MODELS)
def test_a_choice_and_a_regex_are_obeyed(client, model: str) -> None:  # type: ignore[no-untyped-def]
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(
        model=model, messages=USER, extra_body={"structured_outputs": {"choice": choices}}, temperature=1.0
    )
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=model, messages=USER, extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"})
    text = r.choices[0].message.content
    assert len(text) == 6 and text[:3].isupper() and text[4:].isdigit()


def arguments_of(call: Any, tool: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("model", MODELS)
def test_named_and_required_calls_validate_and_a_result_continues(client, model: str) -> None:  # type: ignore[no-untyped-def]
    question = [{"role": "user", "content": "Weather in Paris this week?"}]
    named = client.chat.completions.create(
        model=model,
        messages=question,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    arguments_of(choice.message.tool_calls[0], WEATHER)
    required = client.chat.completions.create(
        model=model, messages=question, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False
    )
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    arguments_of(calls[0], {"get_weather": WEATHER, "get_time": CLOCK}[calls[0].function.name])
    call = choice.message.tool_calls[0]
    follow_up = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny all week"},
    ]
    r = client.chat.completions.create(
        model=model, messages=follow_up, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    assert r.choices[0].message.tool_calls is None


def test_a_streamed_call_arrives_as_tool_call_deltas(client) -> None:  # type: ignore[no-untyped-def]
    chunks = list(
        client.chat.completions.create(
            model="auto",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_routing_is_the_same_with_a_schema_or_tools(client) -> None:  # type: ignore[no-untyped-def]
    def route(**fields: Any) -> str:
        raw = client.chat.completions.with_raw_response.create(model="auto", messages=USER, max_tokens=4, **fields)
        return str(raw.headers["x-skillpool-route"])

    free = route()
    assert free.startswith("skill-0000")
    assert route(response_format=json_schema(schema_family(seed=5, n=1)[0])) == free
    assert route(tools=[WEATHER], tool_choice="required") == free  # the tools' system prompt is not routed on


def test_a_new_schema_compiles_once_then_comes_from_the_cache(url: str, client) -> None:  # type: ignore[no-untyped-def]
    def compiled() -> int:
        return int(httpx.get(url + "/healthz").json()["grammars_compiled"])

    schema = {
        "type": "object",
        "properties": {"unique_key_for_cache": {"type": "boolean"}},
        "required": ["unique_key_for_cache"],
    }
    before = compiled()
    for _ in range(3):
        client.chat.completions.create(model="base", messages=USER, response_format=json_schema(schema), max_tokens=50)
    assert compiled() == before + 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": json_schema({"type": "integer", "minimum": 5, "maximum": 3})},
            "response_format.json_schema.schema",
        ),
        ({"response_format": json_schema({"type": "nope"})}, "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_json": {"type": "object", "required": 5}}}, "guided_json"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ],
)
def test_bad_input_is_a_400_in_the_openai_envelope(client, fields: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="auto", messages=USER, **fields)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == param and body["code"] == "invalid_value"
