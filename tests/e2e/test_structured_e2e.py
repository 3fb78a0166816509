"""End to end: structured outputs and tool calls from the real SmolLM2 behind `skillpool serve --engine hf`, called
with the unmodified openai SDK, Instructor and an agent loop on the SDK; `model` is auto, a skill, a mix and the
base. The skills are random adapters in the store (a schema's grammar must hold whatever the mix). The vllm
engine's run of the same checks: test_vllm_structured.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from skillpool.evaluation.process import ServerProcess
from skillpool.runtime.base_model import resolve_base_model
from tests.schema_family import schema_family
from tests.synthetic import random_skills, write_store

pytestmark = pytest.mark.slow
BASE = "SmolLM2-135M-Instruct"
MODELS = ["auto", "skill-0000", "skill-0000=0.5,skill-0001=0.5", BASE]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=50)
    capital: bool


def serve(data: Path, engine: str) -> ServerProcess:
    """A server on the packaged SmolLM2 with two random skills in its store."""
    config = json.loads((resolve_base_model().path / "config.json").read_text())
    write_store(data, random_skills(config, 2, rank=8, alpha=16.0))
    flags = ["--engine", engine, "--max-batch-size", "8", "--default-max-tokens", "256"]
    if engine == "vllm":
        flags += ["--max-model-len", "2048", "--max-loras", "2"]
    return ServerProcess(data, flags, startup_s=900)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    with serve(Path(tmp_path_factory.mktemp("structured-hf")) / "data", "hf") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def json_object(client: Any, model: str, max_tokens: int) -> None:
    """A json_object answer ends by itself and parses as an object."""
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object with the name and age of a famous scientist."}],
        response_format={"type": "json_object"},
        max_tokens=max_tokens,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("model", MODELS)
def test_json_object_parses(client, model: str) -> None:  # type: ignore[no-untyped-def]
    json_object(client, model, 256)


@pytest.mark.parametrize("model", MODELS)
def test_a_family_of_schemas_validates_whole_and_streamed(client, model: str) -> None:  # type: ignore[no-untyped-def]
    schemas = schema_family(seed=11, n=4)
    messages = [{"role": "user", "content": "Fill in this form about your favourite city as JSON."}]

    def ask(schema: dict[str, Any]) -> str:
        r = client.chat.completions.create(
            model=model, messages=messages, response_format=json_schema(schema), max_tokens=512, temperature=0
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        return str(r.choices[0].message.content)

    with cf.ThreadPoolExecutor(len(schemas)) as pool:
        for schema, text in zip(schemas, pool.map(ask, schemas)):
            jsonschema.validate(json.loads(text), schema)
    streamed, finish = "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, response_format=json_schema(schemas[0]), max_tokens=512, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", streamed
    jsonschema.validate(json.loads(streamed), schemas[0])


@pytest.mark.parametrize("model", MODELS)
def test_parse_and_choice(client, model: str) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Tell me about Paris, France."}],
        response_format=City,
        max_tokens=256,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, City)
    choices = ["positive", "negative"]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Sentiment of 'I loved this film!'? positive or negative"}],
        extra_body={"structured_outputs": {"choice": choices}},
        temperature=0,
    )
    assert r.choices[0].message.content in choices


def valid_call(call: Any) -> dict[str, Any]:
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def named_call(client: Any, model: str) -> Any:
    """A call forced by name: one, to that function, its arguments valid."""
    named = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    valid_call(call)
    return call


def result_of(call: Any) -> list[dict[str, Any]]:
    """The conversation after the call: the question, the assistant's call and the tool's result."""
    return [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]


@pytest.mark.parametrize("model", MODELS)
def test_named_and_required_calls_and_a_result_that_continues(client, model: str) -> None:  # type: ignore[no-untyped-def]
    call = named_call(client, model)
    required = client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert all(valid_call(c) is not None for c in required.choices[0].message.tool_calls)
    answer = client.chat.completions.create(
        model=model, messages=result_of(call), tools=[WEATHER, CLOCK], max_tokens=64, temperature=0
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls  # the conversation goes on, as text or as a further call
    for c in message.tool_calls or []:
        valid_call(c)


def test_instructor_extracts_a_pydantic_model(client) -> None:  # type: ignore[no-untyped-def]
    import instructor

    extractor = instructor.from_openai(client)  # its default mode: a named tool call
    city = extractor.chat.completions.create(
        model="auto",
        response_model=City,
        messages=[{"role": "user", "content": "Oslo is the capital of Norway; about 1 million people live there."}],
        max_retries=0,
        temperature=0,
    )
    assert isinstance(city, City)


def test_an_agent_loop_runs_a_call_and_its_result_to_a_final_answer(client) -> None:  # type: ignore[no-untyped-def]
    """A plain loop on the SDK: the first turn must call a tool; each call runs; then the model answers."""

    def get_weather(city: str, unit: str) -> dict[str, Any]:
        return {"city": city, "temperature": 18 if unit == "celsius" else 64, "unit": unit, "sky": "sunny"}

    messages: list[dict[str, Any]] = [*ASK_WEATHER]
    ran: list[dict[str, Any]] = []
    for turn in range(2):
        r = client.chat.completions.create(
            model="auto",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required" if turn == 0 else "none",
            max_tokens=96,
            temperature=0,
        )
        message = r.choices[0].message
        if not message.tool_calls:
            break
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            result = get_weather(**json.loads(call.function.arguments))
            ran.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    assert ran and turn == 1
    assert r.choices[0].finish_reason in ("stop", "length") and message.content


def test_the_readme_snippet_runs(client) -> None:  # type: ignore[no-untyped-def]
    """The README's parse() and tool round trip, as written, against this server (its `client`)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (snippet,) = [code for code in re.findall(r"```python\n(.*?)```", readme, re.S) if ".parse(" in code]
    scope: dict[str, Any] = {"client": client}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["call"].function.name == "get_weather" and json.loads(scope["call"].function.arguments)["city"]
