"""ChatCompletionRequest: what it takes, and each error as the API reports it (message, param, code)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from skillpool.server.chat.protocol import ChatCompletionRequest, request_schema
from skillpool.server.engines.protocol import SAMPLING_EPS
from skillpool.server.errors import APIError

USER = {"role": "user", "content": "hi"}


def error(body: Any) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(APIError) as e:
        ChatCompletionRequest.parse(body)
    return e.value.status, e.value.message, e.value.param, e.value.code


def test_a_request_as_the_engine_takes_it() -> None:
    r = ChatCompletionRequest.parse(
        {
            "model": "auto",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant"},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 3,
            "stop": ["", "x"],
            "top_p": 0,
            "stream": 0,
            "stream_options": {"include_usage": 1},
            "metadata": {"expected_skill": "sst-2"},
            "n": 1,
            "user": "ignored",
        }
    )
    assert r.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    assert (r.stream, r.include_usage, r.expected_skill) == (False, True, "sst-2")
    sp = r.to_sampling_params(room=100, default_max_tokens=50)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.stop) == (3, 1.0, SAMPLING_EPS, ("x",))
    assert ChatCompletionRequest.parse({"model": "m", "messages": [USER]}).to_sampling_params(20, 50).max_tokens == 20


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ([], (400, "request body must be a JSON object", None, "invalid_json")),
        ({"functions": [{}]}, (400, "functions is not supported by this server", "functions", "unsupported_parameter")),
        ({"n": 2}, (400, "only n=1 is supported", "n", "unsupported_parameter")),
        ({"messages": [USER]}, (400, "model is required (use 'auto' to route)", "model", "invalid_value")),
        ({"model": "m", "messages": []}, (400, "messages must be a non-empty list", "messages", "invalid_value")),
        (
            {"model": "m", "messages": [USER, {"role": ["user"]}]},
            (
                400,
                "messages[1].role must be one of system, developer, user, assistant, tool",
                "messages[1].role",
                "invalid_value",
            ),
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            (
                400,
                "messages[0].content[0]: only text content parts are supported",
                "messages[0].content",
                "invalid_value",
            ),
        ),
        (
            {"model": "m", "messages": [USER], "max_completion_tokens": 0, "max_tokens": 5},
            (400, "max_tokens must be a positive integer, got 0", "max_tokens", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "seed": 2**63},
            (400, f"seed must be a 64-bit signed integer, got {2**63}", "seed", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "temperature": True},
            (400, "temperature must be a number between 0.0 and 2.0, got True", "temperature", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "metadata": {"k": 1}},
            (400, "metadata keys are strings up to 64 characters, values up to 512", "metadata.k", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "ignore_eos": None},
            (400, "ignore_eos must be a boolean", "ignore_eos", "invalid_value"),
        ),
    ],
)
def test_each_error_names_its_field(body: Any, expected: tuple[int, str, str | None, str]) -> None:
    assert error(body) == expected


def test_the_first_field_in_check_order_is_reported() -> None:
    assert error({"model": "", "messages": [], "seed": "x"})[2] == "model"
    assert error({"model": "m", "messages": [USER], "stream": 1, "top_p": 5})[2] == "stream"


def test_the_documented_schema_is_self_contained() -> None:
    schema = request_schema()
    text = json.dumps(schema)
    assert "$ref" not in text and "$defs" not in text
    assert schema["required"] == ["model", "messages"]
    assert schema["properties"]["messages"]["items"]["required"] == ["role", "content"]
