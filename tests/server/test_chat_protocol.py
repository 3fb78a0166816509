"""ChatCompletionRequest: what it takes, and each error as the API reports it (message, param, code)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from skillpool.server.chat.protocol import ChatCompletionRequest, request_schema
from skillpool.server.engines.protocol import SAMPLING_EPS
from skillpool.server.errors import APIError

USER = {"role": "user", "content": "hi"}
VOCAB = 1000


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
    sp = r.to_sampling_params(room=100, default_max_tokens=50, vocab_size=VOCAB)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.stop) == (3, 1.0, SAMPLING_EPS, ("x",))
    assert (sp.n, sp.logprobs, sp.logit_bias, sp.top_k) == (1, None, (), 0)
    plain = ChatCompletionRequest.parse({"model": "m", "messages": [USER]})
    assert plain.to_sampling_params(20, 50, VOCAB).max_tokens == 20


def test_the_sampling_fields_reach_the_engine() -> None:
    r = ChatCompletionRequest.parse(
        {
            "model": "m",
            "messages": [USER],
            "n": 3,
            "seed": -5,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "logit_bias": {"42": -100, "7": 2.5},
            "logprobs": True,
            "top_logprobs": 4,
            "top_k": -1,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "best_of": 1,
            "use_beam_search": False,
        }
    )
    sp = r.to_sampling_params(100, 50, VOCAB)
    assert (sp.n, sp.seed, sp.presence_penalty, sp.frequency_penalty) == (3, -5, 0.5, -1.0)
    assert sp.logit_bias == ((42, -100.0), (7, 2.5)) and sp.logprobs == 4
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (0, 0.1, 1.2, 2)
    assert ChatCompletionRequest.parse({"model": "m", "messages": [USER], "logprobs": True}).top == 0
    nulls = {"n": None, "presence_penalty": None, "top_k": None, "repetition_penalty": None, "logprobs": None}
    assert ChatCompletionRequest.parse({"model": "m", "messages": [USER], **nulls}).to_sampling_params(9, 9, VOCAB) == (
        ChatCompletionRequest.parse({"model": "m", "messages": [USER]}).to_sampling_params(9, 9, VOCAB)
    )


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias: 99999 is not a token id of this model"),
        ({"min_tokens": 51}, "min_tokens", "min_tokens (51) must be at most max_tokens (50)"),
    ],
)
def test_what_only_the_serving_knows_is_checked_there(extra: dict, param: str, message: str) -> None:
    r = ChatCompletionRequest.parse({"model": "m", "messages": [USER], "max_tokens": 50, **extra})
    with pytest.raises(APIError) as e:
        r.to_sampling_params(100, 50, VOCAB)
    assert (e.value.status, e.value.param) == (400, param) and e.value.message.startswith(message)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ([], (400, "request body must be a JSON object", None, "invalid_json")),
        ({"functions": [{}]}, (400, "functions is not supported by this server", "functions", "unsupported_parameter")),
        (
            {"model": "m", "messages": [USER], "n": 17},
            (400, "n must be an integer from 1 to 16, got 17", "n", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "n": 0},
            (400, "n must be an integer from 1 to 16, got 0", "n", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "logprobs": True, "top_logprobs": 21},
            (400, "top_logprobs must be an integer from 0 to 20, got 21", "top_logprobs", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "top_logprobs": 2},
            (400, "top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "presence_penalty": 3},
            (400, "presence_penalty must be a number between -2 and 2, got 3", "presence_penalty", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "frequency_penalty": -2.5},
            (
                400,
                "frequency_penalty must be a number between -2 and 2, got -2.5",
                "frequency_penalty",
                "invalid_value",
            ),
        ),
        (
            {"model": "m", "messages": [USER], "logit_bias": {"5": 101}},
            (400, "logit_bias[5] must be a number between -100 and 100, got 101", "logit_bias", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "logit_bias": {"-1": 1}},
            (400, "logit_bias keys must be token ids (non-negative integers), got '-1'", "logit_bias", "invalid_value"),
        ),
        (
            {"model": "m", "messages": [USER], "repetition_penalty": 0},
            (
                400,
                "repetition_penalty must be a number above 0 and at most 10, got 0",
                "repetition_penalty",
                "invalid_value",
            ),
        ),
        (
            {"model": "m", "messages": [USER], "top_k": -2},
            (
                400,
                "top_k must be an integer: -1 or 0 for every token, else how many of the likeliest, got -2",
                "top_k",
                "invalid_value",
            ),
        ),
        (
            {"model": "m", "messages": [USER], "best_of": 2},
            (400, "best_of is not supported by this server", "best_of", "unsupported_parameter"),
        ),
        (
            {"model": "m", "messages": [USER], "echo": True},
            (400, "echo is not supported by this server", "echo", "unsupported_parameter"),
        ),
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
