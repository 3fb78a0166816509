"""Serving a (legacy) completion: tokenize each prompt, route it on its text, generate (generation.py), answer.

Every prompt is checked (its ids in the vocabulary, the context) before any is routed, then all are routed and
submitted at once; one that the engine refuses ends the others. Choices come back in order: prompt by prompt,
each prompt's n choices in turn. A client that goes away aborts every prompt's request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skillpool.router import Decision

from ..chat.protocol import route_field
from ..chat.target import resolve_target
from ..engines import EngineEvent, SamplingParams
from ..errors import APIError
from ..generation import Choice, ClientGone, Generation, sse, stream_error, usage
from .protocol import (
    CompletionRequest,
    LegacyLogprobs,
    completion_choice,
    completion_id,
    join_logprobs,
    text_completion,
)

if TYPE_CHECKING:
    from ..components import Components


@dataclass
class _Prompt:
    ids: list[int]
    text: str
    sampling: SamplingParams | None = None
    decision: Decision | None = None


class CompletionServing:
    def __init__(self, c: Components) -> None:
        self.c = c

    async def create(self, request: Request, body: CompletionRequest, t0: float) -> Response:
        c = self.c
        gen = Generation(c, request, t0)
        target = resolve_target(c, body.model)
        prompts = await asyncio.to_thread(self._tokenize, body)  # a long prompt takes a while: off the event loop
        for p in prompts:
            max_tokens = body.max_tokens or None  # 0 (echo alone) generates one token, then drops it (vLLM's way)
            room = gen.room(len(p.ids), max_tokens, "prompt")
            logprobs = body.logprobs
            p.sampling = body.sampling_params(
                max_tokens or min(room, c.cfg.serving.default_max_tokens),
                c.vocab.size,
                logprobs=logprobs,
                prompt_logprobs=logprobs if body.echo else None,
                constraint=body.output.constraint if body.output is not None else None,
            )
        if prompts:  # one constraint for every prompt: compiled once
            await gen.prepare(prompts[0].sampling, body.output.param if body.output is not None else None)  # type: ignore[arg-type]
        decisions = await asyncio.gather(*(gen.route(target, p.text, body.model, body.expected_skill) for p in prompts))
        for p, d in zip(prompts, decisions):
            p.decision = d
        cid = completion_id()
        try:
            streams = await _start_all(gen, cid, prompts)
            headers = {"x-skillpool-route": decisions[0].header()}
            if body.stream:
                return StreamingResponse(
                    self._stream(cid, streams, body, prompts), media_type="text/event-stream", headers=headers
                )
            answers = await asyncio.gather(*(gen.collect(s, body.n) for s in streams))
        except ClientGone:
            return Response(status_code=499)
        choices, completion = [], 0
        for i, (p, answer) in enumerate(zip(prompts, answers)):
            for ch in answer:
                choices.append(self._choice(i * body.n + ch.index, p, ch, body, len(prompts) > 1))
                completion += ch.tokens if body.generates else 0
        prompt_tokens = sum(len(p.ids) for p in prompts)
        out = text_completion(
            cid, body.model, choices, usage=usage(prompt_tokens, completion), skillpool=route_field(decisions[0])
        )
        return JSONResponse(out, headers=headers)

    def _tokenize(self, body: CompletionRequest) -> list[_Prompt]:
        vocab, out = self.c.vocab, []
        for i, p in enumerate(body.prompts()):
            if isinstance(p, str):
                out.append(_Prompt(vocab.encode(p), p))
                continue
            if (bad := vocab.outside(p)) is not None:
                where = "prompt" if isinstance(body.prompt[0], int) else f"prompt[{i}]"
                raise APIError(
                    400,
                    f"{where}: {bad} is not a token id of this model (its vocabulary is 0 to {vocab.size - 1})",
                    "prompt",
                    "invalid_value",
                )
            out.append(_Prompt(p, vocab.decode(p)))
        if any(not p.ids for p in out):
            raise APIError(400, "prompt has no tokens", "prompt", "invalid_value")
        return out

    def _choice(self, index: int, p: _Prompt, ch: Choice, body: CompletionRequest, several: bool) -> dict[str, Any]:
        """One whole choice: the prompt first under echo, the generated text unless max_tokens was 0."""
        text = (p.text if body.echo else "") + (ch.text if body.generates else "")
        finish = ch.finish if body.generates else "length"
        logprobs = None
        if body.logprobs is not None:
            lp = LegacyLogprobs(self.c.vocab)
            blocks = [lp.block(ch.prompt_logprobs or (), first=p.ids[0])] if body.echo else []
            if body.generates:
                blocks.append(lp.block(ch.logprobs))
            logprobs = join_logprobs(blocks)
        extra = {"skillpool": route_field(p.decision)} if several and p.decision is not None else {}
        return completion_choice(index, text, finish, logprobs, **extra)

    async def _stream(
        self, cid: str, streams: list[AsyncIterator[EngineEvent]], body: CompletionRequest, prompts: list[_Prompt]
    ) -> AsyncIterator[str]:
        created, n = int(time.time()), body.n
        offsets = [LegacyLogprobs(self.c.vocab) for _ in range(len(prompts) * n)]
        tokens = [0] * len(offsets)
        opened: set[int] = set()

        def chunk(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None, **extra: Any) -> str:
            choice = completion_choice(index, text, finish, logprobs)
            return sse({**text_completion(cid, body.model, [choice], **extra), "created": created})

        try:
            async for i, ev in _merged(streams):
                index, p = i * n + ev.index, prompts[i]
                first = index not in opened
                opened.add(index)
                extra = {"skillpool": route_field(p.decision)} if first and p.decision is not None else {}
                if first and body.echo:  # the prompt first, with its logprobs
                    lp = (
                        offsets[index].block(ev.prompt_logprobs or (), first=p.ids[0])
                        if body.logprobs is not None
                        else None
                    )
                    yield chunk(index, p.text, None, lp, **extra)
                    extra = {}
                if body.generates:
                    tokens[index] = ev.tokens
                    lp = offsets[index].block(ev.logprobs) if body.logprobs is not None and ev.logprobs else None
                    if ev.text or lp or extra:  # a choice's first chunk carries its routing decision
                        yield chunk(index, ev.text, None, lp, **extra)
                        extra = {}
                if ev.finish_reason is not None:
                    yield chunk(index, "", ev.finish_reason if body.generates else "length", None, **extra)
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            yield sse(stream_error(e))
            return
        if body.include_usage:
            used = usage(sum(len(p.ids) for p in prompts), sum(tokens))
            yield sse({**text_completion(cid, body.model, [], usage=used), "created": created})
        yield "data: [DONE]\n\n"


async def _start_all(gen: Generation, cid: str, prompts: list[_Prompt]) -> list[AsyncIterator[EngineEvent]]:
    """Every prompt's request submitted at once (their prefills share steps); if one is refused, the others are
    aborted and its refusal is the answer."""
    several = len(prompts) > 1
    results = await asyncio.gather(
        *(
            gen.start(f"{cid}-{i}" if several else cid, p.ids, p.sampling, p.decision)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
        ),
        return_exceptions=True,
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r.aclose()  # type: ignore[attr-defined]
        raise failed[0]
    return results  # type: ignore[return-value]


async def _merged(streams: list[AsyncIterator[EngineEvent]]) -> AsyncIterator[tuple[int, EngineEvent]]:
    """The prompts' events as they come, each with its prompt's index; closing it closes (aborts) them all."""
    if len(streams) == 1:
        try:
            async for ev in streams[0]:
                yield 0, ev
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, EngineEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[EngineEvent]) -> None:
        try:
            async for ev in s:
                queue.put_nowait((i, ev))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
