"""POST /v1/responses, stateless: the request (`ResponsesRequest`), its conversion into a chat request, and the
response object and typed stream events as OpenAI's Responses API shapes them.

Nothing is kept between calls: `previous_response_id`, `store: true`, `conversation` and `background` are refused
with a 400 that says so, and so are the built-in tools (this server runs none). `to_chat` is the one place a
Responses request becomes a chat request: instructions as the system message, input items as messages (a
`function_call` item as an assistant's tool call, a `function_call_output` as a tool message), `text.format` as
`response_format`, function tools in chat's shape; the serving then generates exactly as chat does, output format
and tool calls included, and an error of a converted field names it as this API does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from skillpool.router import Decision

from ..chat.protocol import ChatCompletionRequest, content_logprobs, route_field
from ..chat.tools import ToolCall
from ..engines.protocol import MAX_LOGPROBS, TokenLogprob
from ..errors import APIError
from ..openai_request import Metadata, api_error, check_metadata, inline_schema, invalid
from ..tokens import Vocabulary

LOGPROBS = "message.output_text.logprobs"  # the one `include` this server can add to an answer
_STATEFUL = {
    "previous_response_id": "previous_response_id is not supported: this server keeps no responses (send the whole "
    "conversation as input)",
    "conversation": "conversation is not supported: this server keeps no conversations (send the whole conversation "
    "as input)",
    "prompt": "prompt is not supported: this server keeps no prompt templates",
}
# set to anything but these, a field asks for what this server does not do
_REFUSED: dict[str, Any] = {"background": False, "moderation": None, "context_management": None, "image": None}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """An OpenAI Responses API request, as this stateless server takes it."""

    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        "model": "model is required (use 'auto' to route)",
        "input": "input must be a string or a list of messages",
        "instructions": "instructions must be a string",
        "max_output_tokens": "max_output_tokens must be a positive integer, got {input!r}",
        "temperature": "temperature must be a number between 0.0 and 2.0, got {input!r}",
        "top_p": "top_p must be a number between 0.0 and 1.0, got {input!r}",
        "stream": "stream must be a boolean",
        "top_logprobs": f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {{input!r}}",
        "include": "include must be a list of strings",
    }

    model: str = Field(min_length=1, strict=True, description="'auto' routes; a skill name or the base id pins")
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of messages")
    instructions: str | None = Field(default=None, strict=True, description="the system message, before the input")
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    stream: bool = Field(default=False, strict=True)
    metadata: Metadata | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, strict=True)
    include: list[str] | None = Field(default=None, description=f"'{LOGPROBS}': each output token's logprob")
    store: bool | None = Field(default=None, description="only false: nothing is stored")
    parallel_tool_calls: bool | None = None
    truncation: str | None = Field(default=None, description="only 'disabled': a too long input is a 400")
    text: dict[str, Any] | None = Field(default=None, description="text.format: text, json_object or json_schema")
    tools: list[dict[str, Any]] | None = Field(default=None, description="function tools: {type, name, parameters}")
    tool_choice: str | dict[str, Any] | None = Field(default=None, description="none, auto, required or a function")

    @classmethod
    def parse(cls, body: Any) -> ResponsesRequest:
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise api_error(e.errors()[0], cls.FIELD_ERRORS) from None

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, body: Any) -> Any:
        """The body asks for nothing a stateless server without tools cannot do."""
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object", None, "invalid_json")
        for key, why in _STATEFUL.items():
            if body.get(key) not in (None, ""):
                raise invalid(why, key, "unsupported_parameter")
        if body.get("store") is True:
            raise invalid(
                "store: true is not supported: this server keeps no responses (use false)",
                "store",
                "unsupported_parameter",
            )
        for key, noop in _REFUSED.items():
            if body.get(key) not in (None, noop):
                raise invalid(f"{key} is not supported by this server", key, "unsupported_parameter")
        _tools(body.get("tools"))
        _text_format(body.get("text"))
        if body.get("truncation") not in (None, "disabled"):
            raise invalid("only truncation 'disabled' is supported: a too long input is an error", "truncation")
        return {**body, "stream": body.get("stream") or False}

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, meta: Any) -> Any:
        return check_metadata(meta)

    @field_validator("input", mode="after")
    @classmethod
    def _input(cls, given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The input as chat messages (text content)."""
        messages = _messages(given)
        if not any(m["role"] == "user" for m in messages):
            raise invalid("input must hold a user message", "input")
        return messages  # type: ignore[return-value]

    @field_validator("include", mode="before")
    @classmethod
    def _include(cls, include: Any) -> Any:
        if include is not None and not isinstance(include, list):
            raise invalid("include must be a list of strings", "include")
        for item in include or []:
            if item != LOGPROBS:
                raise invalid(
                    f"include: only '{LOGPROBS}' is supported, got {item!r}", "include", "unsupported_parameter"
                )
        return include

    @property
    def logprobs(self) -> int | None:
        """The alternatives per output token the engine computes: None unless `include` asks for logprobs."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or []) else None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this Responses request is: instructions as the system message, then the input's
        messages; max_output_tokens as max_tokens; text.format as response_format; function tools, tool_choice and
        parallel_tool_calls in chat's shape; the sampling fields as they are. A converted field's error names it
        as this API does (text.format..., tools[i]...)."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        assert isinstance(self.input, list)  # chat messages once validated (_input)
        messages += self.input
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens}
        body.update(temperature=self.temperature, top_p=self.top_p, metadata=self.metadata)
        if self.logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.logprobs)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        body["parallel_tool_calls"] = self.parallel_tool_calls
        try:
            return ChatCompletionRequest.parse(body)
        except APIError as e:
            e.param = _responses_param(e.param)
            raise


def _messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages with text content; any other item (a function call, an image, a reference to a
    stored item) is a 400 naming it."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise invalid("input must be a non-empty string or list", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            out.append(_call_item(item, i, kind, out))
            continue
        if kind != "message":
            raise invalid(
                f"input[{i}]: items of type {kind!r} are not supported (messages, function calls and their outputs)",
                f"input[{i}]",
                "unsupported_parameter",
            )
        role, content = item.get("role"), item.get("content")
        if role not in _ROLES:
            raise invalid(f"input[{i}].role must be one of {', '.join(_ROLES)}", f"input[{i}].role")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in _TEXT_PARTS
                    or not isinstance(part.get("text"), str)
                ):
                    raise invalid(
                        f"input[{i}].content[{j}]: only text parts are supported",
                        f"input[{i}].content",
                        "unsupported_parameter",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise invalid(f"input[{i}].content must be a string or a list of text parts", f"input[{i}].content")
        out.append({"role": role, "content": content})
    return out


def _call_item(item: dict[str, Any], i: int, kind: str, before: list[dict[str, Any]]) -> dict[str, Any]:
    """A function call the model made (as an assistant message's tool call: consecutive calls join one message),
    or its output (as a tool message)."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"input[{i}].call_id must be a non-empty string", f"input[{i}].call_id")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise invalid(f"input[{i}].output must be a string", f"input[{i}].output")
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise invalid(f"input[{i}]: a function_call has a name and arguments (strings)", f"input[{i}]")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if before and before[-1]["role"] == "assistant" and before[-1].get("tool_calls") and not before[-1]["content"]:
        before[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
        return before.pop()
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _tools(tools: Any) -> None:
    """Function tools are taken (as chat takes them); the built-in ones would need tools this server does not run."""
    if tools in (None, []):
        return
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise invalid("tools must be a list of tools", "tools")
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise invalid(
                f"built-in tools are not available: this server runs no tools ({t.get('type')!r})",
                f"tools[{i}]",
                "unsupported_parameter",
            )


def _text_format(text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise invalid("text must be an object", "text")
    fmt = text.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise invalid("text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "text.format")


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """text.format as chat's response_format: the Responses API flattens json_schema's fields into the format."""
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) in chat's nested shape."""
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _responses_param(param: str | None) -> str | None:
    """A converted field's name as this API spells it."""
    if param is None:
        return None
    for chat, ours in (
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("messages", "input"),
        ("max_tokens", "max_output_tokens"),
    ):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours + param[len(chat) :]
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    return param


def function_call_item(call: ToolCall) -> dict[str, Any]:
    """An output item for a call the model made: the client runs it and sends its output back as input."""
    item = call.as_openai()
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": item["id"],
        "name": item["function"]["name"],
        "arguments": item["function"]["arguments"],
        "status": "completed",
    }


def request_schema() -> dict[str, Any]:
    return inline_schema(ResponsesRequest)


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def output_logprobs(vocab: Vocabulary, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """An output_text's `logprobs`: the chat API's entries (token, logprob, bytes, top_logprobs)."""
    content: list[dict[str, Any]] = content_logprobs(vocab, lps)["content"]
    return content


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message(mid: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def response_object(
    rid: str,
    body: ResponsesRequest,
    created: float,
    status: str,
    output: list[dict[str, Any]],
    d: Decision,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The response: `status` in_progress, completed, or incomplete (the token limit), with the decision."""
    done = status != "in_progress"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "completed_at": time.time() if done else None,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": body.model,
        "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": None,
        "store": False,
        "temperature": body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else responses_usage(**usage),
        "skillpool": route_field(d),
    }


def responses_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
