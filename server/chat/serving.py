"""Serving a chat completion: pick the target, tokenize, route (the routing stage), generate (the engine), answer.

A request is tokenized off the event loop, routed, and submitted to the engine with its decision; the
first engine event decides between an answer and an error before any response starts (a full queue is
a 429 with Retry-After). A client that goes away aborts its request, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skillpool.router import Decision
from skillpool.router.texts import route_text

from ..engines import (
    ConstraintError,
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    RequestTooLarge,
    SamplingParams,
)
from ..errors import APIError, store_unavailable
from .protocol import ChatCompletionRequest, chat_chunk, chat_completion, completion_id, route_field
from .target import resolve_target
from .tools import CallReader, CallStream, ToolCall

if TYPE_CHECKING:
    from ..components import Components

log = logging.getLogger(__name__)


class ChatServing:
    def __init__(self, c: Components) -> None:
        self.c, self.m = c, c.metrics

    async def create(self, request: Request, body: ChatCompletionRequest, t0: float) -> Response:
        """The response to `body`: JSON, or an event stream when it asks for one. `t0`: when the request came."""
        c = self.c
        target = resolve_target(c, body.model)
        messages = body.chat_messages()
        prompt, tools = body.template_input(c.engine.takes_tools)
        # a long prompt takes seconds to template and tokenize: never on the event loop
        prompt_ids = await asyncio.to_thread(c.engine.encode_chat, prompt, tools)
        room = c.engine.max_context - len(prompt_ids)
        max_tokens = body.requested_max_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {c.engine.max_context} tokens; the messages use {len(prompt_ids)} "
                f"and max_tokens asks for {max_tokens}",
                "messages" if room < 1 else "max_tokens",
                "context_length_exceeded",
            )
        sampling = body.to_sampling_params(room, c.cfg.serving.default_max_tokens)
        await self._prepare(body, sampling)
        try:
            decision = await c.routing.decide(route_text(messages), target)
        except EngineBusy as e:
            raise _busy(e) from None
        if target == "auto":
            c.routing_log.record(decision)  # the console's routing share and fallbacks per window
        if body.expected_skill is not None and body.model == "auto":
            self._count_label(body.expected_skill, decision)
        if c.store.remote:  # the mix's adapters onto this node's disk now, off the engine's thread
            await asyncio.to_thread(c.pool.fetch_adapters, decision.mix)
        cid = completion_id()
        events = c.engine.generate(EngineRequest(cid, prompt_ids, sampling, decision.mix))
        try:
            first = await _first_event(request, events)  # submits: a full queue answers 429 before any response
        except EngineBusy as e:
            raise _busy(e) from None
        except EngineDead as e:  # liveness is red already: fail at once, never queue to a dead loop
            raise APIError(503, str(e), None, "engine_unavailable") from None
        except RequestTooLarge as e:  # more KV than the engine has, even alone: waiting would not help
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        except ConstraintError as e:  # a replica's grammar engine refused it (the ingress checks first)
            raise APIError(400, str(e), body.output.param if body.output else None, "invalid_value") from None
        if first is None:  # the client left while the request waited for a slot or its prefill
            return Response(status_code=499)
        if first.finish_reason == "error" and first.not_found:  # a skill retired between routing and the engine
            raise APIError(404, f"{first.error}", "model", "model_not_found")
        if first.finish_reason == "error" and first.unavailable:  # a cold skill, and the adapter store is down
            raise store_unavailable(first.error, "model")
        if first.finish_reason == "error":
            raise APIError(500, f"generation failed: {first.error}", None, "internal_error")
        headers = {"x-skillpool-route": decision.header()}
        self.m.tokens.labels("prompt").inc(len(prompt_ids))
        stream = self._timed(first, events, t0)
        if body.stream:
            return StreamingResponse(
                self._stream(cid, stream, body, decision, len(prompt_ids)),
                media_type="text/event-stream",
                headers=headers,
            )
        return await self._complete(request, cid, stream, body, decision, len(prompt_ids), headers)

    async def _prepare(self, body: ChatCompletionRequest, sampling: SamplingParams) -> None:
        """The request's constraint compiled (or found compiled) off the event loop and the engine's loop; what the
        grammar engine refuses is a 400 naming the field it came from."""
        if sampling.constraint is None:
            return
        try:
            await asyncio.to_thread(self.c.engine.prepare, sampling)
        except ConstraintError as e:
            param = body.output.param if body.output is not None else None
            raise APIError(400, f"{param}: {e}", param, "invalid_value") from None

    def _count_label(self, expected: str, decision: Decision) -> None:
        """Live routing accuracy from labelled traffic: was the top-1 route the skill the client expected?
        Names the pool does not serve count as "other", so clients cannot grow the label set unbounded."""
        c = self.c
        label = "base" if expected in ("base", c.base.model_id) else (c.pool.resolve(expected) or "other")
        top = decision.route[0][0] if decision.route else "base"
        self.m.labelled.labels(label, "true" if top == label else "false").inc()

    async def _timed(
        self, first: EngineEvent, events: AsyncIterator[EngineEvent], t0: float
    ) -> AsyncIterator[EngineEvent]:
        """The request's events with latency metrics; closing it early aborts the request in the engine."""
        m = self.m
        t_first = time.perf_counter()
        m.ttft.observe(t_first - t0)
        ev = first
        try:
            while True:
                if ev.finish_reason == "error":
                    raise RuntimeError(ev.error or "generation failed")
                yield ev
                if ev.finish_reason is not None:
                    if ev.tokens > 1:
                        m.inter_token.observe((time.perf_counter() - t_first) / (ev.tokens - 1))
                    m.tokens.labels("completion").inc(ev.tokens)  # its duration: the middleware's, once
                    return
                ev = await anext(events)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _complete(
        self,
        request: Request,
        cid: str,
        stream: AsyncIterator[EngineEvent],
        body: ChatCompletionRequest,
        d: Decision,
        n_prompt: int,
        headers: dict[str, str],
    ) -> Response:
        parts: list[str] = []
        finish, ntok = "stop", 0

        async def collect() -> None:
            nonlocal finish, ntok
            async for ev in stream:
                parts.append(ev.text)
                finish, ntok = ev.finish_reason or finish, ev.tokens

        task = asyncio.ensure_future(collect())
        if not await _unless_gone(request, task):  # a client that disconnects aborts its request, frees its slot
            return Response(status_code=499)
        try:
            task.result()
        except RuntimeError as e:
            raise APIError(500, f"generation failed: {e}", None, "internal_error") from None
        usage = {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok}
        message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        spec = body.tool_spec
        if spec is not None and spec.active:
            content, calls = CallReader(spec).read(message["content"])
            if calls:
                message = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [t.as_openai() for t in calls],
                }
                finish = "tool_calls" if finish == "stop" else finish
        return JSONResponse(chat_completion(cid, body.model, message, finish, usage, d), headers=headers)

    async def _stream(
        self, cid: str, stream: AsyncIterator[EngineEvent], body: ChatCompletionRequest, d: Decision, n_prompt: int
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        yield sse(chat_chunk(cid, body.model, created, {"role": "assistant", "content": ""}, skillpool=route_field(d)))
        ntok = 0
        spec = body.tool_spec
        calls = CallStream(spec) if spec is not None and spec.active else None

        def deltas(items: Iterable[str | ToolCall]) -> Iterator[str]:
            for item in items:
                if isinstance(item, str):
                    yield sse(chat_chunk(cid, body.model, created, {"content": item}))
                else:  # a call goes out whole, as the first (and only) delta of its index
                    assert calls is not None
                    call = {"index": len(calls.calls) - 1, **item.as_openai()}
                    yield sse(chat_chunk(cid, body.model, created, {"tool_calls": [call]}))

        try:
            async for ev in _closing(stream):
                ntok = ev.tokens
                if ev.text:
                    for chunk in deltas(calls.push(ev.text) if calls is not None else [ev.text]):
                        yield chunk
                if ev.finish_reason is not None:
                    finish = ev.finish_reason
                    if calls is not None:
                        for chunk in deltas(calls.finish()):
                            yield chunk
                        finish = "tool_calls" if calls.calls and finish == "stop" else finish
                    yield sse(chat_chunk(cid, body.model, created, {}, finish))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            log.exception("stream failed")
            yield sse(
                {
                    "error": {
                        "message": f"generation failed: {e}",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
                }
            )
            return
        if body.include_usage:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok}
            yield sse(chat_chunk(cid, body.model, created, None, usage=usage))
        yield "data: [DONE]\n\n"


def _busy(e: EngineBusy) -> APIError:
    return APIError(
        429,
        f"the server is busy ({e.waiting} requests waiting); retry later",
        None,
        "server_busy",
        headers={"Retry-After": str(e.retry_after_s)},
    )


async def _unless_gone(request: Request, task: asyncio.Future[Any]) -> bool:
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


async def _first_event(request: Request, events: AsyncIterator[EngineEvent]) -> EngineEvent | None:
    """The request's first event, or None (and the request aborted) if the client disconnects first."""
    task = asyncio.ensure_future(anext(events))
    if not await _unless_gone(request, task):
        await events.aclose()  # type: ignore[attr-defined]  # closed unfinished: the engine aborts the request
        return None
    return task.result()


async def _closing(stream: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    """Close the request's events as soon as the response stops (a client that left aborts now, not at GC)."""
    try:
        async for ev in stream:
            yield ev
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
