"""POST /v1/responses on a tiny LLaMA: the answer equals chat's for the same messages, streamed as the typed events,
with the routing decision; text.format and function tools as chat takes them (a schema's answer validates, a
required call comes back as a function_call item and its output continues the conversation); what a stateless
server without built-in tools cannot do is a 400 that says so."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.server.test_api import assert_error

INSTRUCTIONS = "Answer in one word."
QUESTION = "What colour is the sky?"


def respond(client: TestClient, **kw):  # type: ignore[no-untyped-def]
    body = {"model": "tiny-llama", "input": QUESTION, "max_output_tokens": 6, "temperature": 0, **kw}
    return client.post("/v1/responses", json=body)


def chat_answer(client: TestClient, messages: list[dict], max_tokens: int = 6) -> str:
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def test_a_response_is_chats_answer_to_the_same_messages(client: TestClient) -> None:
    r = respond(client, instructions=INSTRUCTIONS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "incomplete"
    [part] = item["content"]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    assert part["type"] == "output_text" and part["text"] == chat_answer(client, messages)
    assert body["usage"]["output_tokens"] == 6 and body["store"] is False
    assert body["skillpool"]["reason"] == "base" and r.headers["x-skillpool-route"] == "base"


def test_input_as_messages_with_text_parts(client: TestClient) -> None:
    history = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "And at night?"},
    ]
    r = respond(client, input=history)
    assert r.status_code == 200, r.text
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at night?"},
    ]
    assert r.json()["output"][0]["content"][0]["text"] == chat_answer(client, messages)


def test_logprobs_when_included(client: TestClient) -> None:
    r = respond(client, include=["message.output_text.logprobs"], top_logprobs=3)
    part = r.json()["output"][0]["content"][0]
    assert len(part["logprobs"]) == 6
    for lp in part["logprobs"]:
        assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 3 and lp["top_logprobs"][0]["token"] == lp["token"]
        assert bytes(lp["bytes"]).decode("utf-8", "replace") == lp["token"]
    assert "logprobs" not in respond(client).json()["output"][0]["content"][0]


def test_the_stream_is_the_typed_events_and_adds_up_to_the_response(client: TestClient) -> None:
    whole = respond(client).json()
    with client.stream(
        "POST",
        "/v1/responses",
        json={"model": "tiny-llama", "input": QUESTION, "max_output_tokens": 6, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    text = whole["output"][0]["content"][0]["text"]
    assert deltas == text == events[-4]["text"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["skillpool"]["reason"] == "base"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert events[-1]["response"]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_parameter"),
        ({"tools": [{"type": "function", "name": "bad name!", "parameters": {}}]}, "tools[0].name", None),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format.schema", None),
        ({"text": {"format": {"type": "xml"}}}, "text.format", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"input": []}, "input", None),
        ({"input": 5}, "input", None),
        (  # a call's output that answers no call
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                ]
            },
            "input[1].tool_call_id",
            None,
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            None,
        ),
        ({"input": [{"role": "assistant", "content": "hi"}]}, "input", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"temperature": -1}, "temperature", None),
        ({"top_logprobs": 21}, "top_logprobs", None),
        ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
        ({"include": 5}, "include", None),
        ({"text": "plain"}, "text", None),
        ({"truncation": "auto"}, "truncation", None),
        ({"model": "nope"}, "model", "model_not_found"),
    ],
)
def test_what_is_not_kept_or_not_done_is_a_400(client: TestClient, extra: dict, param: str, code: str | None) -> None:
    status = 404 if code == "model_not_found" else 400
    assert_error(respond(client, **extra), status, param, code)
    if param in ("previous_response_id", "store"):
        assert "keeps no responses" in respond(client, **extra).json()["error"]["message"]


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_json_schema_format_answers_json_that_validates(client: TestClient) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["blue", "grey", "black"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "sky", "schema": schema, "strict": True}
    r = respond(client, text={"format": fmt}, max_output_tokens=40)
    assert r.status_code == 200, r.text
    body = r.json()
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), schema)
    assert body["text"] == {"format": fmt}  # the response says what it was asked for


def test_a_required_function_call_comes_back_as_an_item_and_its_output_continues(client: TestClient) -> None:
    r = respond(client, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=60)
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["call_id"]
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {k: calls[0][k] for k in ("type", "call_id", "name", "arguments")},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"celsius": 4}'},
    ]
    after = respond(client, input=history, tools=[WEATHER])
    assert after.status_code == 200, after.text
    assert after.json()["output"], after.json()


def test_a_streamed_call_arrives_as_a_function_call_item(client: TestClient) -> None:
    body = {
        "model": "tiny-llama",
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/responses", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done and json.loads(done[0]["arguments"])["city"] is not None
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final][-1] == "function_call" and final[-1]["arguments"] == done[0]["arguments"]
