"""POST /v1/chat/completions: parse, pick the target, route (the routing stage), generate (the engine), answer.

A request is tokenized off the event loop, routed, and submitted to the engine with its decision; the
first engine event decides between an answer and an error before any response starts (a full queue is
a 429 with Retry-After). A client that goes away aborts its request, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skillpool.router import Decision
from skillpool.trainer.datasets import route_text

from .engines import EngineBusy, EngineDead, EngineEvent, EngineRequest, Mix, SamplingParams
from .errors import APIError, read_json
from .openai_api import (
    CHAT_REQUEST_SCHEMA,
    ChatParams,
    chat_chunk,
    chat_completion,
    completion_id,
    parse_chat_request,
    route_field,
)
from .routing import Target

if TYPE_CHECKING:
    from .components import Components

log = logging.getLogger(__name__)

# Weights are relative; a bound keeps their sum finite (1e308 twice overflowed to inf, and inf/inf is NaN).
MAX_MIX_WEIGHT = 1e6


def _target(c: Components, model: str) -> Target:
    """'auto' routes; the base model id (or 'base') means no adapter; a skill name (or a fine-tuning job's
    fine_tuned_model id) forces that skill;
    'skill=weight,skill=weight' forces that mix (weights renormalized)."""
    if model == "auto":
        return "auto"
    if model in (c.base.model_id, "base"):
        return "base"
    if (skill := c.pool.resolve(model)) is not None:  # a skill name or its fine_tuned_model id
        return skill
    if "=" in model:
        return _explicit_mix(c, model)
    raise APIError(
        404,
        f"The model '{model}' does not exist (use 'auto', '{c.base.model_id}' or a skill name)",
        "model",
        "model_not_found",
    )


def _explicit_mix(c: Components, model: str) -> Mix:
    mix: dict[str, float] = {}
    for part in model.split(","):
        name, _, raw = part.partition("=")
        try:
            w = float(raw)
        except ValueError:
            w = math.nan
        if not math.isfinite(w) or w <= 0 or w > MAX_MIX_WEIGHT:
            raise APIError(
                400,
                f"mix weight for {name!r} must be a number in (0, {MAX_MIX_WEIGHT:g}], got {raw!r}",
                "model",
                "invalid_value",
            )
        if c.pool.get(name) is None:
            raise APIError(404, f"The model '{name}' in the mix does not exist", "model", "model_not_found")
        mix[name] = mix.get(name, 0.0) + w
    cap = c.cfg.max_loaded_skills
    if cap is not None and len(mix) > cap:
        raise APIError(
            400, f"the mix names {len(mix)} skills; this server keeps {cap} loaded", "model", "invalid_value"
        )
    return Mix.of(mix)  # renormalized; responses list it heaviest first, ties as written


def _busy(e: EngineBusy) -> APIError:
    return APIError(
        429,
        f"the server is busy ({e.waiting} requests waiting); retry later",
        None,
        "server_busy",
        headers={"Retry-After": str(e.retry_after_s)},
    )


async def _unless_gone(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait for the task; False (and the task cancelled) if the client disconnects first."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
    return True


async def _first_event(request: Request, events: AsyncIterator[EngineEvent]) -> EngineEvent | None:
    """The request's first event, or None (and the request aborted) if the client disconnects first."""
    task = asyncio.ensure_future(anext(events))
    if not await _unless_gone(request, task):
        await events.aclose()  # type: ignore[attr-defined]  # closed unfinished: the engine aborts the request
        return None
    return task.result()


def install_chat(app: FastAPI, c: Components) -> None:
    m = c.metrics

    @app.post(
        "/v1/chat/completions",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": CHAT_REQUEST_SCHEMA}}}
        },
    )
    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        body = await read_json(request)
        params = parse_chat_request(body)
        target = _target(c, params.model)
        # a long prompt takes seconds to template and tokenize: never on the event loop
        prompt_ids = await asyncio.to_thread(c.engine.encode_chat, params.messages)
        room = c.engine.max_context - len(prompt_ids)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {c.engine.max_context} tokens; the messages use {len(prompt_ids)} "
                f"and max_tokens asks for {params.max_tokens}",
                "messages" if room < 1 else "max_tokens",
                "context_length_exceeded",
            )
        try:
            decision = await c.routing.decide(route_text(params.messages), target)
        except EngineBusy as e:
            raise _busy(e) from None
        if params.expected_skill is not None and params.model == "auto":
            _count_label(params.expected_skill, decision)
        cid = completion_id()
        sampling = SamplingParams(
            max_tokens=params.max_tokens or min(room, c.cfg.default_max_tokens),
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=tuple(params.stop),
            ignore_eos=params.ignore_eos,
        )
        events = c.engine.generate(EngineRequest(cid, prompt_ids, sampling, decision.mix))
        try:
            first = await _first_event(request, events)  # submits: a full queue answers 429 before any response
        except EngineBusy as e:
            raise _busy(e) from None
        except EngineDead as e:  # liveness is red already: fail at once, never queue to a dead loop
            raise APIError(503, str(e), None, "engine_unavailable") from None
        if first is None:  # the client left while the request waited for a slot or its prefill
            return Response(status_code=499)
        if first.finish_reason == "error" and first.not_found:  # a skill retired between routing and the engine
            raise APIError(404, f"{first.error}", "model", "model_not_found")
        if first.finish_reason == "error":
            raise APIError(500, f"generation failed: {first.error}", None, "internal_error")
        headers = {"x-skillpool-route": decision.header()}
        m.tokens.labels("prompt").inc(len(prompt_ids))
        stream = _timed(first, events, t0)
        if params.stream:
            return StreamingResponse(
                _stream(cid, stream, params, decision, len(prompt_ids)), media_type="text/event-stream", headers=headers
            )
        return await _complete(request, cid, stream, params, decision, len(prompt_ids), headers)

    def _count_label(expected: str, decision: Decision) -> None:
        """Live routing accuracy from labelled traffic: was the top-1 route the skill the client expected?
        Names the pool does not serve count as "other", so clients cannot grow the label set unbounded."""
        label = "base" if expected in ("base", c.base.model_id) else (c.pool.resolve(expected) or "other")
        top = decision.route[0][0] if decision.route else "base"
        m.labelled.labels(label, "true" if top == label else "false").inc()

    async def _timed(first: EngineEvent, events: AsyncIterator[EngineEvent], t0: float) -> AsyncIterator[EngineEvent]:
        """The request's events with latency metrics; closing it early aborts the request in the engine."""
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
                    m.tokens.labels("completion").inc(ev.tokens)
                    m.request_seconds.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
                    return
                ev = await anext(events)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _closing(stream: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
        """Close the request's events as soon as the response stops (a client that left aborts now, not at GC)."""
        try:
            async for ev in stream:
                yield ev
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _complete(
        request: Request,
        cid: str,
        stream: AsyncIterator[EngineEvent],
        params: ChatParams,
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
        return JSONResponse(chat_completion(cid, params.model, "".join(parts), finish, usage, d), headers=headers)

    async def _stream(
        cid: str, stream: AsyncIterator[EngineEvent], params: ChatParams, d: Decision, n_prompt: int
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        yield sse(
            chat_chunk(cid, params.model, created, {"role": "assistant", "content": ""}, skillpool=route_field(d))
        )
        ntok = 0
        try:
            async for ev in _closing(stream):
                ntok = ev.tokens
                if ev.text:
                    yield sse(chat_chunk(cid, params.model, created, {"content": ev.text}))
                if ev.finish_reason is not None:
                    yield sse(chat_chunk(cid, params.model, created, {}, ev.finish_reason))
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
        if params.include_usage:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok}
            yield sse(chat_chunk(cid, params.model, created, None, usage=usage))
        yield "data: [DONE]\n\n"
