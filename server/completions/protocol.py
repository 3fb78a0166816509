"""POST /v1/completions: the request (`CompletionRequest`) and the response bodies, as OpenAI's legacy API shapes them.

A prompt is text, a list of texts, token ids or a list of token id lists; each prompt is its own request to the
router and the engine, and its n choices follow each other (prompt i's choice j is choice i * n + j, as in vLLM).
`echo` puts the prompt before each answer, and with `logprobs` (the legacy 0-5) the prompt's tokens get theirs too:
the first one null, having nothing before it. `max_tokens: 0` with `echo` generates nothing: the prompt's logprobs
alone (a loglikelihood, as lm-evaluation-harness asks for them). vLLM's `structured_outputs` (and its older
`guided_*` names) and `response_format` constrain each answer as in chat (chat/output.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from pydantic import Field, PrivateAttr, StrictInt, StrictStr, field_validator, model_validator

from ..chat.output import output_constraint
from ..chat.structured import GUIDED, FormatError, OutputFormat
from ..engines.protocol import TokenLogprob
from ..openai_request import VLLM_UNSUPPORTED, GenerationRequest, inline_schema, invalid, refuse_unsupported
from ..tokens import Vocabulary

MAX_LEGACY_LOGPROBS = 5  # the legacy API's bound on `logprobs`
MAX_PROMPTS = 256  # prompts in one request: each is a request of its own to the engine

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = (
    StrictStr
    | Annotated[list[StrictStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(GenerationRequest):
    """An OpenAI (legacy) completion request, as this server takes it."""

    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        **GenerationRequest.FIELD_ERRORS,
        "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
        "max_tokens": "max_tokens must be a non-negative integer (0 only with echo), got {input!r}",
        "echo": "echo must be a boolean",
        "logprobs": f"logprobs must be an integer from 0 to {MAX_LEGACY_LOGPROBS}, got {{input!r}}",
    }

    prompt: Prompt = Field(description="text, texts, token ids or lists of token ids; 'auto' routes each on its text")
    max_tokens: int | None = Field(default=None, ge=0, strict=True, description="0 with echo: the prompt's logprobs")
    echo: bool = Field(default=False, strict=True, description="the prompt before the answer (and its logprobs)")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LEGACY_LOGPROBS, strict=True, description="each token's logprob and this many more"
    )
    # each answer's constraint, checked together (_output_format) as chat checks them
    response_format: Any = Field(default=None, description="{'type': 'text' | 'json_object' | 'json_schema', ...}")
    structured_outputs: Any = Field(default=None, description="vLLM's: one of json, regex, choice, grammar")
    guided_json: Any = Field(default=None, description="vLLM's older name of structured_outputs.json")
    guided_regex: Any = Field(default=None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: Any = Field(default=None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: Any = Field(default=None, description="vLLM's older name of structured_outputs.grammar")
    _output: OutputFormat | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        """The body is an object that asks for nothing we cannot do."""
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object", None, "invalid_json")
        if body.get("suffix") not in (None, ""):
            raise invalid(
                "suffix is not supported by this server (no model here fills in the middle)",
                "suffix",
                "unsupported_parameter",
            )
        refuse_unsupported(body, VLLM_UNSUPPORTED)
        return {**body, "echo": body.get("echo") or False}

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, str):
            if not prompt:
                raise invalid("prompt must not be empty", "prompt")
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise invalid("prompt must be a non-empty string or a non-empty list", "prompt")
        if len(prompt) > MAX_PROMPTS and not all(isinstance(t, int) for t in prompt):
            raise invalid(f"prompt may hold at most {MAX_PROMPTS} prompts", "prompt")
        for i, p in enumerate(prompt):
            if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
                raise invalid(f"prompt[{i}] must not be empty", "prompt")
        return prompt

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens 0 generates nothing: it needs echo (the prompt's logprobs)", "max_tokens")
        return self

    @model_validator(mode="after")
    def _output_format(self) -> CompletionRequest:
        """Each answer's constraint, checked once (as chat's, without tools)."""
        try:
            guided = {k: getattr(self, k) for k in GUIDED}
            self._output = output_constraint(self.response_format, self.structured_outputs, guided)
        except FormatError as e:
            raise invalid(e.message, e.param) from None
        if self._output is not None and (self.ignore_eos or self.max_tokens == 0):
            raise invalid(
                "a constrained answer ends where its grammar does: no ignore_eos or max_tokens 0", "max_tokens"
            )
        return self

    @property
    def output(self) -> OutputFormat | None:
        return self._output

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def generates(self) -> bool:
        """Whether the answer has any generated text (max_tokens 0 with echo: the prompt alone)."""
        return self.max_tokens != 0


def request_schema() -> dict[str, Any]:
    return inline_schema(CompletionRequest)


def completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex[:24]


class LegacyLogprobs:
    """A choice's `logprobs` as the legacy API writes them: `tokens`, `token_logprobs`, `top_logprobs` (each
    position's likeliest tokens and its own, as vLLM gives them) and `text_offset`, built as tokens come."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab, self.offset = vocab, 0

    def block(self, lps: Sequence[TokenLogprob | None], first: int | None = None) -> dict[str, Any]:
        """The next tokens' block; `first`: a prompt's first token, which has no logprob (null)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if first is not None:
            self._add(out, first, None, None)
        for lp in lps:
            assert lp is not None
            top = {self.vocab.token_text(t): v for t, v in lp.top}
            top.setdefault(self.vocab.token_text(lp.token), lp.logprob)
            self._add(out, lp.token, lp.logprob, top)
        return out

    def _add(self, out: dict[str, list[Any]], token: int, logprob: float | None, top: dict[str, float] | None) -> None:
        text = self.vocab.token_text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text)


def join_logprobs(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {k: [v for b in blocks for v in b[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_choice(
    index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}


def text_completion(cid: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        **extra,
    }
