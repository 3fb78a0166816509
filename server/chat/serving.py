"""Serving a chat completion: pick the target, tokenize, route and generate (generation.py), answer.

A request is tokenized off the event loop (its tools rendered through the chat template), its output constraint
compiled off the loops, routed, and submitted to the engine with its decision; its n choices come back as JSON,
or as a stream of chunks each naming its choice. An answer that calls tools comes back as OpenAI's `tool_calls`.
A client that goes away aborts its request, streaming or not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skillpool.router import Decision
from skillpool.router.texts import route_text

from ..engines import EngineEvent
from ..generation import Choice, ClientGone, Generation, closing, sse, stream_error, usage
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
from .tools import CallReader, CallStream, ToolCall

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
        prompt, tools = body.template_input(c.engine.takes_tools)
        # a long prompt takes seconds to template and tokenize: never on the event loop
        prompt_ids = await asyncio.to_thread(c.engine.encode_chat, prompt, tools)
        room = gen.room(len(prompt_ids), body.requested_max_tokens, "messages")
        sampling = body.to_sampling_params(room, c.cfg.serving.default_max_tokens, c.vocab.size)
        param = body.output.param if body.output is not None else None
        await gen.prepare(sampling, param)
        decision = await gen.route(target, route_text(messages), body.model, body.expected_skill)
        cid = completion_id()
        try:
            stream = await gen.start(cid, prompt_ids, sampling, decision, constraint_param=param)
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
        out = []
        for ch in choices:
            message, finish = self._message(body, ch)
            logprobs = content_logprobs(c.vocab, ch.logprobs) if body.logprobs else None
            out.append(chat_choice(ch.index, message, finish, logprobs))
        used = usage(len(prompt_ids), sum(ch.tokens for ch in choices))
        return JSONResponse(chat_completion(cid, body.model, out, used, decision), headers=headers)

    @staticmethod
    def _message(body: ChatCompletionRequest, ch: Choice) -> tuple[dict[str, Any], str]:
        """A choice's assistant message and finish reason: its text, or the tool calls it made (`tool_calls`)."""
        content, calls = tool_calls(body, ch.text)
        if not calls:
            return {"role": "assistant", "content": ch.text}, ch.finish
        message = {"role": "assistant", "content": content or None, "tool_calls": [t.as_openai() for t in calls]}
        return message, "tool_calls" if ch.finish == "stop" else ch.finish

    async def _stream(
        self, cid: str, stream: AsyncIterator[EngineEvent], body: ChatCompletionRequest, d: Decision, n_prompt: int
    ) -> AsyncIterator[str]:
        created, vocab = int(time.time()), self.c.vocab
        for i in range(body.n):  # each choice opens with its role (the first chunk also carries the decision)
            extra: dict[str, Any] = {"skillpool": route_field(d)} if i == 0 else {}
            yield sse(chat_chunk(cid, body.model, created, {"role": "assistant", "content": ""}, index=i, **extra))
        tokens = [0] * body.n
        spec = body.tool_spec
        calls = [CallStream(spec) for _ in range(body.n)] if spec is not None and spec.active else None

        def deltas(index: int, items: Iterable[str | ToolCall], logprobs: dict[str, Any] | None) -> Iterator[str]:
            for item in items:
                if isinstance(item, str):
                    delta: dict[str, Any] = {"content": item}
                else:  # a call goes out whole, as the first (and only) delta of its index
                    assert calls is not None
                    delta = {"tool_calls": [{"index": len(calls[index].calls) - 1, **item.as_openai()}]}
                yield sse(chat_chunk(cid, body.model, created, delta, index=index, logprobs=logprobs))
                logprobs = None  # a token's logprobs go out once, with the first delta it makes

        try:
            async for ev in closing(stream):
                tokens[ev.index] = ev.tokens
                logprobs = content_logprobs(vocab, ev.logprobs) if body.logprobs and ev.logprobs else None
                if ev.text or logprobs:
                    text: list[str | ToolCall] = [ev.text]
                    if calls is not None:
                        text = list(calls[ev.index].push(ev.text))
                    if not text and logprobs:  # held back by a call in the making: its logprobs still go out
                        text = [""]
                    for chunk in deltas(ev.index, text, logprobs):
                        yield chunk
                if ev.finish_reason is not None:
                    finish = ev.finish_reason
                    if calls is not None:
                        for chunk in deltas(ev.index, calls[ev.index].finish(), None):
                            yield chunk
                        finish = "tool_calls" if calls[ev.index].calls and finish == "stop" else finish
                    yield sse(chat_chunk(cid, body.model, created, {}, finish, index=ev.index))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            yield sse(stream_error(e))
            return
        if body.include_usage:
            yield sse(chat_chunk(cid, body.model, created, None, usage=usage(n_prompt, sum(tokens))))
        yield "data: [DONE]\n\n"


def tool_calls(body: ChatCompletionRequest, text: str) -> tuple[str, list[ToolCall]]:
    """An answer's text outside its tool calls, and the calls (none unless the request offered tools)."""
    spec = body.tool_spec
    if spec is None or not spec.active:
        return text, []
    return CallReader(spec).read(text)
