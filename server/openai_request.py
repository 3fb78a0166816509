"""What every generating endpoint's request shares (chat, completions): the model, the sampling fields and how their
errors reach a client.

The model's types and bounds are what /openapi.json documents (so /docs shows them and the schema fuzz test sends
real bodies). Its errors keep this API's wire messages: a check whose message names more than one field, or an
index, raises `invalid` with the message and the `param` to report; any other failure of a field is reported with
that field's line in the model's `FIELD_ERRORS`. `parse` turns the first error into the 400 envelope, so pydantic's
own messages and 422 never reach a client. Fields are checked in order: the shared ones first, then the
endpoint's own.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, Field, StringConstraints, ValidationError, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from .engines.protocol import (
    MAX_BIAS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    PENALTY,
    SAMPLING_EPS,
    SEED_MAX,
    SEED_MIN,
    Constraint,
    SamplingParams,
)
from .errors import APIError

MAX_STOP_CHARS = 256  # per stop string: each is searched for in the decoded tail after every token
MAX_BIASED_TOKENS = 1024  # logit_bias entries: each is a scatter into the row's logits at every step
MAX_TOP_K = 1_000_000  # beyond any vocabulary: top_k that large keeps every token

# vLLM's sampling extensions this server does not implement, with the value that asks for nothing
VLLM_UNSUPPORTED: dict[str, Any] = {
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "bad_words": [],
    "allowed_token_ids": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
}

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]
R = TypeVar("R", bound="GenerationRequest")


def invalid(message: str, param: str | None, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error that reaches the client as is: this message, this param, this code."""
    return PydanticCustomError(code, "{message}", {"message": message, "param": param})


def api_error(err: ErrorDetails, lines: dict[str, str], params: dict[str, str] | None = None) -> APIError:
    """The 400 a validation error makes: its own message and param (`invalid`), or its field's line in `lines`
    (reported under `params`' name for the field, if it has one)."""
    ctx = err.get("ctx") or {}
    if "message" in ctx and "param" in ctx:
        return APIError(400, ctx["message"], ctx["param"], err["type"])
    name = str(err["loc"][0]) if err["loc"] else None
    line = lines.get(name or "")
    message = line.format(input=err["input"]) if line else f"{name}: {err['msg']}"
    return APIError(400, message, (params or {}).get(name or "", name), "invalid_value")


def refuse_unsupported(body: dict[str, Any], fields: dict[str, Any]) -> None:
    """A 400 naming the first of `fields` the body sets to anything but its no-op value (or null)."""
    for key, noop in fields.items():
        value = body.get(key)
        if value is not None and value != noop:
            raise invalid(f"{key} is not supported by this server", key, "unsupported_parameter")


def check_metadata(meta: Any) -> Any:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > 16:
        raise invalid("metadata must be an object of at most 16 string pairs", "metadata")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise invalid("metadata keys are strings up to 64 characters, values up to 512", f"metadata.{k}")
    return meta


class StreamOptions(BaseModel):
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _truthy(cls, v: Any) -> bool:
        return bool(v)


class GenerationRequest(BaseModel):
    """The model and the sampling fields of an OpenAI generation request, with vLLM's sampling extensions."""

    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        "model": "model is required (use 'auto' to route)",
        "seed": "seed must be a 64-bit signed integer, got {input!r}",
        "stream": "stream must be a boolean",
        "stream_options": "stream_options must be an object",
        "ignore_eos": "ignore_eos must be a boolean",
        "temperature": "temperature must be a number between 0.0 and 2.0, got {input!r}",
        "top_p": "top_p must be a number between 0.0 and 1.0, got {input!r}",
        "n": f"n must be an integer from 1 to {MAX_N}, got {{input!r}}",
        "presence_penalty": f"presence_penalty must be a number between -{PENALTY:g} and {PENALTY:g}, got {{input!r}}",
        "frequency_penalty": f"frequency_penalty must be a number between -{PENALTY:g} and {PENALTY:g}, got {{input!r}}",
        "top_k": "top_k must be an integer: -1 or 0 for every token, else how many of the likeliest, got {input!r}",
        "min_p": "min_p must be a number between 0.0 and 1.0, got {input!r}",
        "repetition_penalty": f"repetition_penalty must be a number above 0 and at most {MAX_REPETITION_PENALTY:g}, "
        "got {input!r}",
        "min_tokens": "min_tokens must be a non-negative integer, got {input!r}",
    }
    PARAMS: ClassVar[dict[str, str]] = {}  # a field reported under another name (max_completion_tokens)

    # the fields in the order they are checked: a body with several errors reports the first one's
    model: str = Field(min_length=1, strict=True, description="'auto' routes; a skill name or the base id pins")
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    seed: int | None = Field(
        default=None, ge=SEED_MIN, le=SEED_MAX, strict=True, description="choice i of n samples with seed + i"
    )
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(
        default=False, strict=True, description="vLLM's extension (benchmarks): decode max_tokens even past the end"
    )
    metadata: Metadata | None = Field(
        default=None, description="metadata.expected_skill: a label that feeds the live routing accuracy"
    )
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    n: int = Field(default=1, ge=1, le=MAX_N, strict=True, description="choices; they share the prompt's prefill")
    presence_penalty: float = Field(default=0.0, ge=-PENALTY, le=PENALTY, strict=True)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY, le=PENALTY, strict=True)
    logit_bias: dict[str, float] | None = Field(
        default=None, description=f"token id -> a bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}] added to its logit"
    )
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K, strict=True, description="vLLM's: -1 or 0 for all tokens")
    min_p: float = Field(default=0.0, ge=0, le=1, strict=True, description="vLLM's")
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=MAX_REPETITION_PENALTY, strict=True, description="vLLM's: 1 for none"
    )
    min_tokens: int = Field(default=0, ge=0, strict=True, description="vLLM's: at most max_tokens")

    @classmethod
    def parse(cls: type[R], body: Any) -> R:
        """The request in `body` (parsed JSON), or the APIError (400) that its first error makes."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise api_error(e.errors()[0], cls.FIELD_ERRORS, cls.PARAMS) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str):
            stops = [] if stop is None else [stop]
        elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
            stops = stop
        else:
            raise invalid("stop must be a string or a list of at most 4 strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise invalid(f"each stop string must be at most {MAX_STOP_CHARS} characters", "stop")
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
        return check_metadata(meta)

    @field_validator("n", "presence_penalty", "frequency_penalty", "top_k", "min_p", "min_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: Any) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _no_repetition_penalty(cls, v: Any) -> Any:
        return 1.0 if v is None else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, bias: Any) -> Any:
        """Token ids (as decimal strings, OpenAI's JSON keys) to biases in [-100, 100]; whether each id is in the
        model's vocabulary is the serving's check."""
        if bias is None:
            return None
        if not isinstance(bias, dict) or len(bias) > MAX_BIASED_TOKENS:
            raise invalid(f"logit_bias must be an object of at most {MAX_BIASED_TOKENS} token ids", "logit_bias")
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9):
                raise invalid(f"logit_bias keys must be token ids (non-negative integers), got {k!r}", "logit_bias")
            if isinstance(v, bool) or not isinstance(v, int | float) or not -MAX_BIAS <= v <= MAX_BIAS:
                raise invalid(
                    f"logit_bias[{k}] must be a number between -{MAX_BIAS:g} and {MAX_BIAS:g}, got {v!r}", "logit_bias"
                )
        return bias

    @property
    def stops(self) -> tuple[str, ...]:
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stop if s)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def expected_skill(self) -> str | None:
        return (self.metadata or {}).get("expected_skill")

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); a 400 naming it when an id is not in the model's vocabulary."""
        out = []
        for k, v in (self.logit_bias or {}).items():
            if int(k) >= vocab_size:
                raise APIError(
                    400,
                    f"logit_bias: {k} is not a token id of this model (its vocabulary is 0 to {vocab_size - 1})",
                    "logit_bias",
                    "invalid_value",
                )
            out.append((int(k), float(v)))
        return tuple(out)

    def sampling_params(
        self,
        max_tokens: int,
        vocab_size: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> SamplingParams:
        """The engine's parameters for this request; a 400 for what only the serving can check (min_tokens
        beyond max_tokens, a token id outside the vocabulary)."""
        if self.min_tokens > max_tokens:
            raise APIError(
                400, f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=(1.0 if self.top_p is None else self.top_p) or SAMPLING_EPS,  # OpenAI allows 0: only the top token
            seed=self.seed,
            stop=self.stops,
            ignore_eos=self.ignore_eos,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.bias(vocab_size),
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            constraint=constraint,
        )


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema with its definitions inlined (a request body in an OpenAPI document has no `$defs` of
    its own to refer to)."""
    schema = model.model_json_schema()
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
