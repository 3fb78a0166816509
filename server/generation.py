"""One prompt's way through the routing stage and the engine, shared by chat, completions and responses.

An endpoint builds the prompt's tokens and the engine's parameters; here the request is checked against the context,
routed (the routing stage), submitted with its decision, and its first engine event decides between an answer and
an error before any response starts (a full queue is a 429 with Retry-After). The events that follow are timed
into the latency metrics, and closing them early (a client that went away) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from skillpool.router import Decision

from .engines import (
    ConstraintError,
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    RequestTooLarge,
    SamplingParams,
)
from .engines.protocol import Choices, TokenLogprob
from .errors import APIError, store_unavailable
from .routing import Target

if TYPE_CHECKING:
    from .components import Components

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its answer was ready: the request is aborted, nothing is sent (499)."""


@dataclass
class Choice:
    """One choice's answer, collected from its events."""

    index: int
    parts: list[str] = field(default_factory=list)
    finish: str = "stop"
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, ev: EngineEvent) -> None:
        self.parts.append(ev.text)
        self.finish, self.tokens = ev.finish_reason or self.finish, ev.tokens
        self.logprobs.extend(ev.logprobs)
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event (with a named `event:` line where the API types its events, as Responses does)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n"


def stream_error(e: Exception) -> dict[str, Any]:
    """A failure once a stream's headers are gone: reported in-band, as OpenAI does."""
    log.error("stream failed: %s", e)
    return {
        "error": {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": "internal_error"}
    }


class Generation:
    """What an endpoint asks of the server for one request: check, route, submit, and its timed events."""

    def __init__(self, c: Components, request: Request, t0: float) -> None:
        self.c, self.request, self.t0, self.m = c, request, t0, c.metrics

    def room(self, n_prompt: int, max_tokens: int | None, prompt_param: str) -> int:
        """The tokens the context has left after the prompt; a 400 naming `prompt_param` or max_tokens when the
        prompt, or the prompt and max_tokens, do not fit."""
        limit = self.c.engine.max_context
        room = limit - n_prompt
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt uses {n_prompt} and max_tokens "
                f"asks for {max_tokens}",
                prompt_param if room < 1 else "max_tokens",
                "context_length_exceeded",
            )
        return room

    async def prepare(self, sampling: SamplingParams, param: str | None) -> None:
        """The request's output constraint compiled (or found compiled) off the event loop and the engine's loop;
        what the grammar engine refuses is a 400 naming `param`, the field it came from."""
        if sampling.constraint is None:
            return
        try:
            await asyncio.to_thread(self.c.engine.prepare, sampling)
        except ConstraintError as e:
            raise APIError(400, f"{param}: {e}", param, "invalid_value") from None

    async def route(self, target: Target, text: str, model: str, expected_skill: str | None = None) -> Decision:
        """The routing decision for `text` (the stage's own for `auto`, forced otherwise), logged and counted."""
        c = self.c
        try:
            decision = await c.routing.decide(text, target)
        except EngineBusy as e:
            raise busy(e) from None
        if target == "auto":
            c.routing_log.record(decision)  # the console's routing share and fallbacks per window
        if expected_skill is not None and model == "auto":
            self._count_label(expected_skill, decision)
        return decision

    def _count_label(self, expected: str, decision: Decision) -> None:
        """Live routing accuracy from labelled traffic: was the top-1 route the skill the client expected?
        Names the pool does not serve count as "other", so clients cannot grow the label set unbounded."""
        c = self.c
        label = "base" if expected in ("base", c.base.model_id) else (c.pool.resolve(expected) or "other")
        top = decision.route[0][0] if decision.route else "base"
        self.m.labelled.labels(label, "true" if top == label else "false").inc()

    async def start(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        decision: Decision,
        constraint_param: str | None = None,
    ) -> AsyncIterator[EngineEvent]:
        """Submit the request; its events (every choice's, as they come) once the first says it runs. Raises the
        APIError its refusal makes (a refused output constraint names `constraint_param`), or ClientGone."""
        c = self.c
        if c.store.remote:  # the mix's adapters onto this node's disk now, off the engine's thread
            await asyncio.to_thread(c.pool.fetch_adapters, decision.mix)
        events = c.engine.generate(EngineRequest(rid, prompt_ids, sampling, decision.mix))
        try:
            first = await first_event(self.request, events)  # submits: a full queue answers 429 before any response
        except EngineBusy as e:
            raise busy(e) from None
        except EngineDead as e:  # liveness is red already: fail at once, never queue to a dead loop
            raise APIError(503, str(e), None, "engine_unavailable") from None
        except RequestTooLarge as e:  # more KV than the engine has, even alone: waiting would not help
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        except ConstraintError as e:  # a replica's grammar engine refused it (the ingress checks first)
            raise APIError(400, str(e), constraint_param, "invalid_value") from None
        if first is None:  # the client left while the request waited for a slot or its prefill
            raise ClientGone()
        if first.finish_reason == "error" and first.not_found:  # a skill retired between routing and the engine
            await events.aclose()  # type: ignore[attr-defined]
            raise APIError(404, f"{first.error}", "model", "model_not_found")
        if first.finish_reason == "error" and first.unavailable:  # a cold skill, and the adapter store is down
            await events.aclose()  # type: ignore[attr-defined]
            raise store_unavailable(first.error, "model")
        if first.finish_reason == "error":
            await events.aclose()  # type: ignore[attr-defined]
            raise APIError(500, f"generation failed: {first.error}", None, "internal_error")
        self.m.tokens.labels("prompt").inc(len(prompt_ids))
        return self._timed(first, events, sampling.n)

    async def _timed(
        self, first: EngineEvent, events: AsyncIterator[EngineEvent], n: int
    ) -> AsyncIterator[EngineEvent]:
        """The request's events with latency metrics; closing it early aborts the request in the engine."""
        m = self.m
        t_first = time.perf_counter()
        m.ttft.observe(t_first - self.t0)
        ev, choices = first, Choices(n)
        try:
            while True:
                if ev.finish_reason == "error":
                    raise RuntimeError(ev.error or "generation failed")
                yield ev
                if ev.finish_reason is not None:
                    if ev.tokens > 1:
                        m.inter_token.observe((time.perf_counter() - t_first) / (ev.tokens - 1))
                    m.tokens.labels("completion").inc(ev.tokens)  # its duration: the middleware's, once
                if choices.over(ev):
                    return
                ev = await anext(events)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def collect(self, stream: AsyncIterator[EngineEvent], n: int) -> list[Choice]:
        """Every choice's whole answer, in order. A client that disconnects aborts its request (ClientGone)."""
        choices = [Choice(i) for i in range(n)]

        async def gather() -> None:
            async for ev in stream:
                choices[ev.index].add(ev)

        task = asyncio.ensure_future(gather())
        if not await unless_gone(self.request, task):  # a client that disconnects aborts its request, frees its slot
            raise ClientGone()
        try:
            task.result()
        except RuntimeError as e:
            raise APIError(500, f"generation failed: {e}", None, "internal_error") from None
        return choices


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def busy(e: EngineBusy) -> APIError:
    return APIError(
        429,
        f"the server is busy ({e.waiting} requests waiting); retry later",
        None,
        "server_busy",
        headers={"Retry-After": str(e.retry_after_s)},
    )


async def unless_gone(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait for the task; False (and the task cancelled) if the client disconnects first. Cancelled itself (a
    stopping server ends the request), it cancels the task too: asyncio.wait would leave it generating."""
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return False
    except asyncio.CancelledError:
        task.cancel()
        raise
    return True


async def first_event(request: Request, events: AsyncIterator[EngineEvent]) -> EngineEvent | None:
    """The request's first event, or None (and the request aborted) if the client disconnects first."""
    task = asyncio.ensure_future(anext(events))
    if not await unless_gone(request, task):
        await events.aclose()  # type: ignore[attr-defined]  # closed unfinished: the engine aborts the request
        return None
    return task.result()


async def closing(stream: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    """Close the request's events as soon as the response stops (a client that left aborts now, not at GC)."""
    try:
        async for ev in stream:
            yield ev
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
