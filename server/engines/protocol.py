"""The engine contract: value objects and the one interface every engine implements.

Modelled on vLLM's `EngineClient`: the server, the routing stage and the benchmarks talk to an engine
only through `Engine`, so a second engine (vLLM) plugs in without touching them. A request carries its
routing decision already made: `mix` is the weighted set of skills (vLLM's `LoRARequest`, generalised to
a weighted mix; empty = the base model). A `Mix` is valid by construction (finite weights summing to 1), and
a request takes nothing else, so no weight an engine sees can poison a row's logits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from skillpool.lora.adapter import LoRAAdapter
from skillpool.lora.mix import Mix

# vLLM's _SAMPLING_EPS: a lower temperature is greedy (dividing logits by it would overflow to inf, then NaN)
SAMPLING_EPS = 1e-5

# OpenAI's seed is an int64; torch.Generator.manual_seed takes [-2**63, 2**64): anything outside fails.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


ConstraintKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match, as vLLM's `StructuredOutputsParams` names it: `json` (a JSON schema, as JSON
    text), `regex`, `choice` (a JSON list of strings) or `grammar` (Lark or GBNF). Both engines hand it to the same
    grammar engine (llguidance), so they take and refuse the same constraints."""

    kind: ConstraintKind
    spec: str


# The bounds the API checks (OpenAI's, vLLM's): an engine refuses anything outside them, whoever built the request.
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top_logprobs per token
PENALTY = 2.0  # presence and frequency penalties: [-2, 2]
MAX_BIAS = 100.0  # logit_bias values: [-100, 100]
MAX_REPETITION_PENALTY = 10.0  # vLLM's repetition_penalty: (0, 10]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # choice i of n is sampled with seed + i (vLLM's convention)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    n: int = 1  # choices, each its own answer to the same prompt
    presence_penalty: float = 0.0  # OpenAI's: minus this from the logit of every token the answer already holds
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the answer so far
    repetition_penalty: float = 1.0  # vLLM's: logits of tokens in the prompt or answer divided (>0) or multiplied by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    top_k: int = 0  # vLLM's: sample among the k likeliest tokens only (0: all)
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p times the likeliest
    min_tokens: int = 0  # vLLM's: no end of sequence and no stop string before this many tokens
    logprobs: int | None = None  # each generated token's logprob and this many likeliest alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (None: off)
    constraint: Constraint | None = None  # the output's grammar: a token mask per row, after the mix

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("temperature must be in [0, 2] and top_p in (0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY <= getattr(self, name) <= PENALTY:
                raise ValueError(f"{name} must be in [-{PENALTY:g}, {PENALTY:g}]")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if any(not -MAX_BIAS <= b <= MAX_BIAS or t < 0 for t, b in self.logit_bias):
            raise ValueError(f"logit_bias maps token ids to values in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if self.top_k < 0 or not 0.0 <= self.min_p <= 1.0 or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("top_k must be >= 0, min_p in [0, 1] and min_tokens in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with an output constraint (it ends where its grammar does)")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax: temperature 0, or below SAMPLING_EPS."""
        return self.temperature < SAMPLING_EPS

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` (vLLM's: seed + index), so that n choices differ yet each reproduces; an
        engine takes it modulo its generator's range."""
        return None if self.seed is None else self.seed + index


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    mix: Mix = Mix.base()

    def __post_init__(self) -> None:
        if not isinstance(self.mix, Mix):  # raw pairs would skip Mix's checks on their way into the math
            raise TypeError(f"an engine request's mix must be a Mix, got {type(self.mix).__name__}")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob under the model's own distribution (its log-softmax before any penalty, bias or
    temperature: vLLM's raw logprobs), and the `k` likeliest tokens at its position, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineEvent:
    """New text since the previous event of the same choice; `finish_reason` is set on its last one only."""

    text: str = ""
    tokens: int = 0  # completion tokens of this choice so far
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # with finish_reason "error": what went wrong for this request alone
    not_found: bool = False  # with an error: a skill of the mix is not served (retired since routing): a 404
    unavailable: bool = False  # with an error: a skill's adapter could not be read from the adapter store: a 503
    index: int = 0  # the choice (0 to n - 1)
    logprobs: tuple[TokenLogprob, ...] = ()  # with params.logprobs: one per token since the last event, the end of
    # sequence that ended the choice included (vLLM's too), though `tokens` does not count it
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with params.prompt_logprobs, on a choice's first event:
    # one per prompt token after the first (the first has no context to be predicted from)


class Choices:
    """Which of a request's n choices have ended: the request is over when all have, or at its first error
    (an error before the choices exist, such as a retired skill, is the whole request's)."""

    def __init__(self, n: int) -> None:
        self.left = set(range(n))
        self.cut = False  # an error ended the request while other choices still ran: they must be aborted

    def over(self, ev: EngineEvent) -> bool:
        """Count the event; True when it is the request's last."""
        if ev.finish_reason == "error":
            self.cut = bool(self.left - {ev.index})
            self.left.clear()
        elif ev.finish_reason is not None:
            self.left.discard(ev.index)
        return not self.left


class EngineDead(Exception):
    """The engine's loop has stopped: nothing submitted now would ever run (the API answers 503)."""

    def __init__(self, engine: str) -> None:
        super().__init__(f"the {engine} engine has stopped; the server must be restarted")


class EngineBusy(Exception):
    """The waiting queue is full: the API answers 429 with Retry-After."""

    def __init__(self, waiting: int, retry_after_s: int = 1) -> None:
        self.waiting, self.retry_after_s = waiting, retry_after_s
        super().__init__(f"{waiting} requests are already waiting for the engine")


class ConstraintError(ValueError):
    """An output constraint the grammar engine refuses (an unsatisfiable schema, a bad regex): the API answers 400."""


class RequestTooLarge(ValueError):
    """A request whose prompt + max_tokens cannot fit the engine's KV memory even alone (the API answers 400)."""


AdapterLoader = Callable[[], LoRAAdapter]  # reads a skill's adapter from the store when it is first used


class Engine(Protocol):
    """What the server needs from an engine. Methods are thread-safe; generate is async."""

    name: str
    max_context: int

    takes_tools: bool  # the chat template renders OpenAI tools itself (else the API renders them into the messages)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The chat template applied and tokenized (blocking: call it off the event loop). `tools`: given only
        where `takes_tools`."""
        ...

    def prepare(self, params: SamplingParams) -> None:
        """Blocking work a request needs before `submit`, off the engine's loop: its constraint compiled (and
        cached). Raises ConstraintError, naming what is wrong, for one the grammar engine cannot take."""
        ...

    def submit(self, request: EngineRequest, sink: Callable[[EngineEvent], None]) -> None:
        """Queue a request from any thread; `sink` gets its events (on the engine's thread). Raises EngineBusy, or
        EngineDead once the engine's loop has stopped."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        """Submit and stream the request's events; closing the iterator early aborts it. Raises EngineBusy."""
        ...

    def abort(self, request_id: str) -> None: ...

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        """Make a skill servable (replacing any older version); its weights may load lazily on first use."""
        ...

    def remove_skill(self, name: str) -> None: ...

    def healthy(self) -> bool: ...

    def last_step_age(self) -> float:
        """Seconds since the engine's loop last completed an iteration; an idle loop still iterates (a bounded
        wait), so this grows only while the loop is stuck or dead."""
        ...

    def stats(self) -> dict[str, int]:
        """running, waiting, resident_skills, known_skills, aborted (requests ended by abort so far),
        adapter_loads (adapters loaded into the engine so far) and, where the engine counts them, adapter_hits
        (adapters a request needed and found loaded)."""
        ...

    def close(self) -> None: ...


class StreamsEvents:
    """`generate` for an engine that has thread-safe `submit` and `abort`: events arrive on the engine's
    thread and are handed to the caller's event loop; closing the iterator early aborts the request."""

    def submit(self, request: EngineRequest, sink: Callable[[EngineEvent], None]) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(ev: EngineEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        self.submit(request, sink)
        choices, finished = Choices(request.params.n), False
        try:
            while True:
                ev = await events.get()
                finished = choices.over(ev)
                yield ev
                if finished:
                    return
        finally:
            if not finished or choices.cut:  # the consumer went away, or one choice failed: free the rest
                self.abort(request.request_id)
