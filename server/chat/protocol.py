"""POST /v1/chat/completions: the request (`ChatCompletionRequest`) and the response bodies, as OpenAI shapes them.

The shared fields (model, sampling) and the way errors reach a client are openai_request.py's. Unknown fields
(user, store, service_tier, parallel_tool_calls, modalities, reasoning_effort...) are accepted and ignored: they do
not change what we generate.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from skillpool.router import Decision

from ..engines.protocol import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ..openai_request import VLLM_UNSUPPORTED, GenerationRequest, inline_schema, refuse_unsupported
from ..openai_request import invalid as _invalid
from ..tokens import Vocabulary

ROLES = ("system", "developer", "user", "assistant")
_UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(json_schema_extra=_content_schema)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # None (or absent) only in an assistant message

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

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        """The body is an object that asks for nothing we cannot do (OpenAI fields we do not implement)."""
        if not isinstance(body, dict):
            raise _invalid("request body must be a JSON object", None, "invalid_json")
        for key in _UNSUPPORTED:
            if body.get(key) not in (None, [], {}):
                raise _invalid(f"{key} is not supported by this server", key, "unsupported_parameter")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise _invalid(
                "only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter"
            )
        refuse_unsupported(body, _VLLM_CHAT)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise _invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        body = {**body, "logprobs": body.get("logprobs") or False}
        if "max_completion_tokens" in body:  # the newer name wins, even given as null: the other is not read
            body.pop("max_tokens", None)
        return body

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, msgs: Any) -> Any:
        if not isinstance(msgs, list) or not msgs:
            raise _invalid("messages must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise _invalid(
                    f"messages[{i}].role must be one of system, developer, user, assistant", f"messages[{i}].role"
                )
            _content(m, i)
        if not any(m["role"] == "user" for m in msgs):
            raise _invalid("messages must contain a user message", "messages")
        return msgs

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content, a developer message as a system one."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

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
        return self.sampling_params(max_tokens, vocab_size, logprobs=self.top)


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


def chat_choice(index: int, text: str, finish: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": logprobs,
    }


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
