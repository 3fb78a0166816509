"""Serving a chat completion: pick the target, tokenize, route and generate (generation.py), answer.

A request is tokenized off the event loop, routed, and submitted to the engine with its decision; its n choices
come back as JSON, or as a stream of chunks each naming its choice. A client that goes away aborts its request,
streaming or not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skillpool.router import Decision
from skillpool.router.texts import route_text

from ..engines import EngineEvent
from ..generation import ClientGone, Generation, closing, sse, stream_error, usage
from .protocol import (
    ChatCompletionRequest,
    chat_choice,
    chat_chunk,
    chat_completion,
    completion_id,
    content_logprobs,
    route_field,
)
from .target import resolve_target

if TYPE_CHECKING:
    from ..components import Components


class ChatServing:
    def __init__(self, c: Components) -> None:
        self.c = c

    async def create(self, request: Request, body: ChatCompletionRequest, t0: float) -> Response:
        """The response to `body`: JSON, or an event stream when it asks for one. `t0`: when the request came."""
        c = self.c
        gen = Generation(c, request, t0)
        target = resolve_target(c, body.model)
        messages = body.chat_messages()
        # a long prompt takes seconds to template and tokenize: never on the event loop
        prompt_ids = await asyncio.to_thread(c.engine.encode_chat, messages)
        room = gen.room(len(prompt_ids), body.requested_max_tokens, "messages")
        sampling = body.to_sampling_params(room, c.cfg.default_max_tokens, c.vocab.size)
        decision = await gen.route(target, route_text(messages), body.model, body.expected_skill)
        cid = completion_id()
        try:
            stream = await gen.start(cid, prompt_ids, sampling, decision)
            headers = {"x-skillpool-route": decision.header()}
            if body.stream:
                return StreamingResponse(
                    self._stream(cid, stream, body, decision, len(prompt_ids)),
                    media_type="text/event-stream",
                    headers=headers,
                )
            choices = await gen.collect(stream, body.n)
        except ClientGone:
            return Response(status_code=499)
        out = [
            chat_choice(ch.index, ch.text, ch.finish, content_logprobs(c.vocab, ch.logprobs) if body.logprobs else None)
            for ch in choices
        ]
        used = usage(len(prompt_ids), sum(ch.tokens for ch in choices))
        return JSONResponse(chat_completion(cid, body.model, out, used, decision), headers=headers)

    async def _stream(
        self, cid: str, stream: AsyncIterator[EngineEvent], body: ChatCompletionRequest, d: Decision, n_prompt: int
    ) -> AsyncIterator[str]:
        created, vocab = int(time.time()), self.c.vocab
        for i in range(body.n):  # each choice opens with its role (the first chunk also carries the decision)
            extra: dict[str, Any] = {"skillpool": route_field(d)} if i == 0 else {}
            yield sse(chat_chunk(cid, body.model, created, {"role": "assistant", "content": ""}, index=i, **extra))
        tokens = [0] * body.n
        try:
            async for ev in closing(stream):
                tokens[ev.index] = ev.tokens
                logprobs = content_logprobs(vocab, ev.logprobs) if body.logprobs and ev.logprobs else None
                if ev.text or logprobs:
                    delta = {"content": ev.text}
                    yield sse(chat_chunk(cid, body.model, created, delta, index=ev.index, logprobs=logprobs))
                if ev.finish_reason is not None:
                    yield sse(chat_chunk(cid, body.model, created, {}, ev.finish_reason, index=ev.index))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            yield sse(stream_error(e))
            return
        if body.include_usage:
            yield sse(chat_chunk(cid, body.model, created, None, usage=usage(n_prompt, sum(tokens))))
        yield "data: [DONE]\n\n"
