"""POST /v1/chat/completions: the request (`ChatCompletionRequest`) and the response bodies, as OpenAI shapes them.

The shared fields (model, sampling) and the way errors reach a client are openai_request.py's. Unknown fields
(user, store, service_tier, modalities, reasoning_effort...) are accepted and ignored: they do not change what we
generate. The output's format and the tools are checked by structured.py and tools.py, and become the engine's
constraint in output.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from skillpool.router import Decision

from ..engines.protocol import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ..openai_request import VLLM_UNSUPPORTED, GenerationRequest, inline_schema, refuse_unsupported
from ..openai_request import invalid as _invalid
from ..tokens import Vocabulary
from .output import output_constraint
from .structured import GUIDED, FormatError, OutputFormat
from .tools import ToolSpec, check_tool_choice, check_tool_messages, check_tools, render

ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED = (
    "functions",
    "function_call",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "audio",
    "prediction",
)
# vLLM's chat extensions that ask for what this server does not do
_VLLM_CHAT = {**VLLM_UNSUPPORTED, "prompt_logprobs": None, "echo": False}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


def _content_schema(schema: dict[str, Any]) -> None:
    """Documented as required text: null or no content at all is taken only in an assistant message."""
    schema["required"] = ["role", "content"]
    content = schema["properties"]["content"]
    content["anyOf"] = [s for s in content["anyOf"] if s.get("type") != "null"]
    content.pop("default", None)


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(default="{}", description="the arguments as a JSON object's text")


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(json_schema_extra=_content_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None (or absent) only in an assistant message
    tool_calls: list[AssistantToolCall] | None = Field(default=None, description="an assistant message's calls")
    tool_call_id: str | None = Field(default=None, description="a tool message's: the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are meaningful to a text model
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """An OpenAI chat completion request, as this server takes it."""

    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        **GenerationRequest.FIELD_ERRORS,
        "messages": "messages must be a non-empty list",
        "max_tokens": "max_tokens must be a positive integer, got {input!r}",
        "max_completion_tokens": "max_tokens must be a positive integer, got {input!r}",
        "logprobs": "logprobs must be a boolean",
        "top_logprobs": f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {{input!r}}",
        "parallel_tool_calls": "parallel_tool_calls must be a boolean",
    }
    PARAMS: ClassVar[dict[str, str]] = {"max_completion_tokens": "max_tokens"}  # reported under the name both share

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, strict=True, description="OpenAI's newer name for max_tokens; given, it wins"
    )
    logprobs: bool = Field(default=False, strict=True, description="each answer token's logprob")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, strict=True, description="with logprobs: the likeliest tokens too"
    )
    parallel_tool_calls: bool | None = Field(default=None, strict=True)
    # checked together once every field is (_output_format): their own errors name the part at fault
    response_format: Any = Field(
        default=None,
        description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {name, schema, strict}}",
    )
    structured_outputs: Any = Field(
        default=None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object"
    )
    guided_json: Any = Field(default=None, description="vLLM's older name of structured_outputs.json")
    guided_regex: Any = Field(default=None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: Any = Field(default=None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: Any = Field(default=None, description="vLLM's older name of structured_outputs.grammar")
    tools: Any = Field(default=None, description="function tools: [{'type': 'function', 'function': {name, ...}}]")
    tool_choice: Any = Field(default=None, description="none, auto, required or {'type': 'function', 'function'}")
    _tools: ToolSpec | None = PrivateAttr(default=None)
    _output: OutputFormat | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        """The body is an object that asks for nothing we cannot do (OpenAI fields we do not implement)."""
        if not isinstance(body, dict):
            raise _invalid("request body must be a JSON object", None, "invalid_json")
        for key in _UNSUPPORTED:
            if body.get(key) not in (None, [], {}):
                raise _invalid(f"{key} is not supported by this server", key, "unsupported_parameter")
        refuse_unsupported(body, _VLLM_CHAT)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise _invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        body = {**body, "logprobs": body.get("logprobs") or False}
        if "max_completion_tokens" in body:  # the newer name wins, even given as null: the other is not read
            body.pop("max_tokens", None)
        return body

    @model_validator(mode="after")
    def _output_format(self) -> ChatCompletionRequest:
        """The output's format and the tools, checked once; kept as the constraint and the tool spec."""
        try:
            tools = check_tools(self.tools) if self.tools is not None else []
            choice = check_tool_choice(self.tool_choice, tools)
            spec = ToolSpec(tuple(tools), choice, self.parallel_tool_calls is not False) if tools else None
            guided = {k: getattr(self, k) for k in GUIDED}
            self._output = output_constraint(self.response_format, self.structured_outputs, guided, spec)
            self._tools = spec
        except FormatError as e:
            raise _invalid(e.message, e.param) from None
        if self._output is not None and self.ignore_eos:
            raise _invalid("ignore_eos cannot be combined with a constrained output", "ignore_eos")
        return self

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, msgs: Any) -> Any:
        if not isinstance(msgs, list) or not msgs:
            raise _invalid("messages must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise _invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
            _content(m, i)
        if not any(m["role"] == "user" for m in msgs):
            raise _invalid("messages must contain a user message", "messages")
        try:
            check_tool_messages(msgs)
        except FormatError as e:
            raise _invalid(e.message, e.param) from None
        return msgs

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages' roles and text, a developer message as a system one (what routing reads)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def tool_spec(self) -> ToolSpec | None:
        """The tools and what the request asks of them (None without tools)."""
        return self._tools

    @property
    def output(self) -> OutputFormat | None:
        """The constraint on the answer (a response format, or tools under `required` or a named function)."""
        return self._output

    def template_input(self, takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools for the chat template (tools.render: the template's way, or the default format)."""
        messages = [
            {**m, "content": m["content"] or ""}
            for m in (
                {
                    "role": "system" if msg.role == "developer" else msg.role,
                    "content": msg.text(),
                    "tool_calls": [c.model_dump() for c in msg.tool_calls or []],
                    "tool_call_id": msg.tool_call_id,
                }
                for msg in self.messages
            )
        ]
        return render(messages, self._tools, takes_tools)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top(self) -> int | None:
        """The logprobs the engine computes per token: None (off), or the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, room: int, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        """`room`: the tokens the context has left after the prompt (a request without max_tokens may use them)."""
        max_tokens = self.requested_max_tokens or min(room, default_max_tokens)
        constraint = self._output.constraint if self._output is not None else None
        return self.sampling_params(max_tokens, vocab_size, logprobs=self.top, constraint=constraint)


def _content(m: dict[str, Any], i: int) -> None:
    """A message's content is text, a list of text parts, or (in an assistant message) nothing."""
    c = m.get("content")
    if (c is None and m.get("role") == "assistant") or isinstance(c, str):
        return
    if isinstance(c, list):
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid(
                    f"messages[{i}].content[{j}]: only text content parts are supported", f"messages[{i}].content"
                )
        return
    raise _invalid(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def request_schema() -> dict[str, Any]:
    """ChatCompletionRequest's JSON schema, self-contained (openai_request.inline_schema)."""
    return inline_schema(ChatCompletionRequest)


def route_field(d: Decision) -> dict[str, Any]:
    return {
        "route": [{"skill": s, "weight": round(w, 4)} for s, w in d.route],
        "reason": d.reason,
        "score": round(d.score, 4),
    }


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def token_logprob(vocab: Vocabulary, token: int, logprob: float) -> dict[str, Any]:
    return {"token": vocab.token_text(token), "logprob": logprob, "bytes": list(vocab.token_bytes(token))}


def content_logprobs(vocab: Vocabulary, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice (or of a chunk's delta): each token with its bytes and its alternatives."""
    return {
        "content": [
            {
                **token_logprob(vocab, lp.token, lp.logprob),
                "top_logprobs": [token_logprob(vocab, t, v) for t, v in lp.top],
            }
            for lp in lps
        ],
        "refusal": None,
    }


def chat_choice(index: int, message: dict[str, Any], finish: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """`message`: the assistant's, {"role", "content"} and, when it calls tools, "tool_calls"."""
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def chat_completion(
    cid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, int], d: Decision
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
        "skillpool": route_field(d),
    }


def chat_chunk(
    cid: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        **extra,
    }
