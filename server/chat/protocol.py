"""POST /v1/chat/completions: the request (`ChatCompletionRequest`) and the response bodies, as OpenAI shapes them.

The model's types and bounds are what /openapi.json documents (so /docs shows them and the schema fuzz test
sends real bodies). Its errors keep this API's wire messages: a check whose message names more than one field,
or an index, raises `_invalid` with the message and the `param` to report; any other failure of a field is
reported with that field's line in `_FIELD_ERRORS`. `parse` turns the first error into the 400 envelope, so
pydantic's own messages and 422 never reach a client. Unknown fields (user, store, service_tier, modalities,
reasoning_effort...) are accepted and ignored: they do not change what we generate. The output's format and the
tools are checked by structured.py and tools.py, and become the engine's constraint in output.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from skillpool.router import Decision

from ..engines.protocol import SAMPLING_EPS, SEED_MAX, SEED_MIN, SamplingParams
from ..errors import APIError
from .output import output_constraint
from .structured import GUIDED, FormatError, OutputFormat
from .tools import ToolSpec, check_tool_choice, check_tool_messages, check_tools, render

MAX_STOP_CHARS = 256  # per stop string: each is searched for in the decoded tail after every token
ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED = (
    "functions",
    "function_call",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "logit_bias",
    "audio",
    "prediction",
    "top_logprobs",
)

# the message of any failure of these fields (a missing model, a max_tokens of 0, a seed past 64 bits...)
_FIELD_ERRORS = {
    "model": "model is required (use 'auto' to route)",
    "messages": "messages must be a non-empty list",
    "max_tokens": "max_tokens must be a positive integer, got {input!r}",
    "max_completion_tokens": "max_tokens must be a positive integer, got {input!r}",
    "seed": "seed must be a 64-bit signed integer, got {input!r}",
    "stream": "stream must be a boolean",
    "stream_options": "stream_options must be an object",
    "ignore_eos": "ignore_eos must be a boolean",
    "temperature": "temperature must be a number between 0.0 and 2.0, got {input!r}",
    "top_p": "top_p must be a number between 0.0 and 1.0, got {input!r}",
    "parallel_tool_calls": "parallel_tool_calls must be a boolean",
}
_PARAMS = {"max_completion_tokens": "max_tokens"}  # reported under the name both spellings share

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error that reaches the client as is: this message, this param, this code."""
    return PydanticCustomError(code, "{message}", {"message": message, "param": param})


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


class StreamOptions(BaseModel):
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _truthy(cls, v: Any) -> bool:
        return bool(v)


class ChatCompletionRequest(BaseModel):
    """An OpenAI chat completion request, as this server takes it."""

    # the fields in the order they are checked: a body with several errors reports the first one's
    model: str = Field(min_length=1, strict=True, description="'auto' routes; a skill name or the base id pins")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, strict=True, description="OpenAI's newer name for max_tokens; given, it wins"
    )
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(
        default=False, strict=True, description="vLLM's extension (benchmarks): decode max_tokens even past the end"
    )
    metadata: (
        Annotated[
            dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = Field(default=None, description="metadata.expected_skill: a label that feeds the live routing accuracy")
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    n: Literal[1] | None = None
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

    @classmethod
    def parse(cls, body: Any) -> ChatCompletionRequest:
        """The request in `body` (parsed JSON), or the APIError (400) that its first error makes."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise _api_error(e.errors()[0]) from None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        """The body is an object that asks for nothing we cannot do (OpenAI fields we do not implement)."""
        if not isinstance(body, dict):
            raise _invalid("request body must be a JSON object", None, "invalid_json")
        for key in _UNSUPPORTED:
            if body.get(key) not in (None, [], {}):
                raise _invalid(f"{key} is not supported by this server", key, "unsupported_parameter")
        if body.get("logprobs"):
            raise _invalid("logprobs is not supported by this server", "logprobs", "unsupported_parameter")
        for key in ("presence_penalty", "frequency_penalty"):
            if body.get(key) not in (None, 0, 0.0):
                raise _invalid(f"{key} is not supported by this server (use 0)", key, "unsupported_parameter")
        if body.get("n") not in (None, 1):
            raise _invalid("only n=1 is supported", "n", "unsupported_parameter")
        body = {**body, "n": None}  # n was 1 or absent (1.0 and true equal 1): nothing more to check
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

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str):
            stops = [] if stop is None else [stop]
        elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
            stops = stop
        else:
            raise _invalid("stop must be a string or a list of at most 4 strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _invalid(f"each stop string must be at most {MAX_STOP_CHARS} characters", "stop")
        return stop

    @field_validator("stream", mode="before")
    @classmethod
    def _stream(cls, v: Any) -> Any:
        return v or False  # null, 0 and "" do not ask for a stream; only true does

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, v: Any) -> Any:
        return v or None  # null, [] and {}: no options

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, meta: Any) -> Any:
        """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
        if meta is None:
            return None
        if not isinstance(meta, dict) or len(meta) > 16:
            raise _invalid("metadata must be an object of at most 16 string pairs", "metadata")
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
                raise _invalid("metadata keys are strings up to 64 characters, values up to 512", f"metadata.{k}")
        return meta

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
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def expected_skill(self) -> str | None:
        return (self.metadata or {}).get("expected_skill")

    def to_sampling_params(self, room: int, default_max_tokens: int) -> SamplingParams:
        """`room`: the tokens the context has left after the prompt (a request without max_tokens may use them)."""
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            max_tokens=self.requested_max_tokens or min(room, default_max_tokens),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=(1.0 if self.top_p is None else self.top_p) or SAMPLING_EPS,  # OpenAI allows 0: only the top token
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            ignore_eos=self.ignore_eos,
            constraint=self._output.constraint if self._output is not None else None,
        )


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


def _api_error(err: ErrorDetails) -> APIError:
    """The 400 a validation error makes: its own message and param (`_invalid`), or its field's line."""
    ctx = err.get("ctx") or {}
    if "message" in ctx and "param" in ctx:
        return APIError(400, ctx["message"], ctx["param"], err["type"])
    name = str(err["loc"][0]) if err["loc"] else None
    line = _FIELD_ERRORS.get(name or "")
    message = line.format(input=err["input"]) if line else f"{name}: {err['msg']}"
    return APIError(400, message, _PARAMS.get(name or "", name), "invalid_value")


def request_schema() -> dict[str, Any]:
    """ChatCompletionRequest's JSON schema with its definitions inlined (a request body in an OpenAPI document
    has no `$defs` of its own to refer to)."""
    schema = ChatCompletionRequest.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    result: dict[str, Any] = inline(schema)
    return result


def route_field(d: Decision) -> dict[str, Any]:
    return {
        "route": [{"skill": s, "weight": round(w, 4)} for s, w in d.route],
        "reason": d.reason,
        "score": round(d.score, 4),
    }


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def chat_completion(
    cid: str, model: str, message: dict[str, Any], finish: str, usage: dict[str, int], d: Decision
) -> dict[str, Any]:
    """`message`: the assistant's, {"role", "content"} and, when it calls tools, "tool_calls"."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
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
