"""OpenAI chat-completions request parsing and response shapes (no FastAPI here)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from skillpool.router import Decision

from .engines.protocol import SAMPLING_EPS, SEED_MAX, SEED_MIN
from .errors import APIError

_ROLES = {"system", "developer", "user", "assistant"}
# Accepted and ignored: they do not change what we generate.
_IGNORED = {
    "user",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "stream_options",
    "modalities",
    "reasoning_effort",
}
_UNSUPPORTED = {
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "prediction",
    "top_logprobs",
}


MAX_STOP_CHARS = 256  # per stop string: each is searched for in the decoded tail after every token

# The request body as OpenAPI documents it (what parse_chat_request accepts; it also rejects the unsupported
# OpenAI fields by name). Declared so that /docs shows it and the schema fuzz test sends real bodies.
CHAT_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "'auto' routes; a skill name or the base id pins"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                    "content": {"type": "string"},
                },
            },
        },
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "stop": {
            "anyOf": [
                {"type": "string", "maxLength": MAX_STOP_CHARS},
                {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": MAX_STOP_CHARS}},
            ]
        },
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "n": {"type": "integer", "enum": [1]},
        "metadata": {
            "type": "object",
            "additionalProperties": {"type": "string", "maxLength": 512},
            "maxProperties": 16,
        },
        "ignore_eos": {"type": "boolean"},
    },
}


@dataclass(frozen=True)
class ChatParams:
    model: str
    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # vLLM's extension (benchmarks): decode max_tokens even past the end of text
    expected_skill: str | None = None  # metadata.expected_skill: a label that feeds the live routing accuracy


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise APIError(400, f"{key} must be a number between {lo} and {hi}, got {v!r}", key, "invalid_value")
    return float(v)


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text parts are meaningful to a text model
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"messages[{i}].content[{j}]: only text content parts are supported",
                    f"messages[{i}].content",
                    "invalid_value",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(
        400,
        f"messages[{i}].content must be a string or a list of text parts",
        f"messages[{i}].content",
        "invalid_value",
    )


def _metadata(meta: Any) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or len(meta) > 16:
        raise APIError(400, "metadata must be an object of at most 16 string pairs", "metadata", "invalid_value")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise APIError(
                400, "metadata keys are strings up to 64 characters, values up to 512", f"metadata.{k}", "invalid_value"
            )
    return meta


def parse_chat_request(body: Any) -> ChatParams:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", None, "invalid_json")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, [], {}):
            raise APIError(400, f"{key} is not supported by this server", key, "unsupported_parameter")
    if body.get("logprobs"):
        raise APIError(400, "logprobs is not supported by this server", "logprobs", "unsupported_parameter")
    rf = body.get("response_format")
    if rf not in (None, {"type": "text"}):
        raise APIError(
            400, "only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter"
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(400, f"{key} is not supported by this server (use 0)", key, "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise APIError(400, "only n=1 is supported", "n", "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required (use 'auto' to route)", "model", "invalid_value")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list", "messages", "invalid_value")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise APIError(
                400,
                f"messages[{i}].role must be one of system, developer, user, assistant",
                f"messages[{i}].role",
                "invalid_value",
            )
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _content(m, i)})
    if not any(m["role"] == "user" for m in messages):
        raise APIError(400, "messages must contain a user message", "messages", "invalid_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens", "invalid_value")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop", "invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"each stop string must be at most {MAX_STOP_CHARS} characters", "stop", "invalid_value")
    stops = [s for s in stops if s]
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise APIError(400, f"seed must be a 64-bit signed integer, got {seed!r}", "seed", "invalid_value")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", "stream", "invalid_value")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise APIError(400, "stream_options must be an object", "stream_options", "invalid_value")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos must be a boolean", "ignore_eos", "invalid_value")
    return ChatParams(
        ignore_eos=ignore_eos,
        expected_skill=_metadata(body.get("metadata")).get("expected_skill"),
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or SAMPLING_EPS,  # OpenAI allows 0: only the top token
        seed=seed,
        stop=stops,
        stream=stream,
        include_usage=bool(so.get("include_usage")),
    )


def route_field(d: Decision) -> dict[str, Any]:
    return {
        "route": [{"skill": s, "weight": round(w, 4)} for s, w in d.route],
        "reason": d.reason,
        "score": round(d.score, 4),
    }


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def chat_completion(cid: str, model: str, text: str, finish: str, usage: dict[str, int], d: Decision) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        ],
        "usage": usage,
        "system_fingerprint": None,
        "skillpool": route_field(d),
    }


def chat_chunk(
    cid: str, model: str, created: int, delta: dict[str, Any] | None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        **extra,
    }
