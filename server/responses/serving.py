"""Serving a response: the request as a chat request (protocol.to_chat), tokenized, routed and generated as chat is
(generation.py), answered as one Response object or as the Responses API's typed events.

A stream is response.created, response.in_progress, the message's output_item.added and content_part.added, one
response.output_text.delta per piece of text, then the done events and response.completed (response.incomplete when
the answer reached max_output_tokens), each numbered by `sequence_number`. A call the model makes (with tools)
is a `function_call` output item after the message: output_item.added, its arguments' delta and done, then
output_item.done.
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

from ..chat.protocol import ChatCompletionRequest
from ..chat.serving import tool_calls
from ..chat.target import resolve_target
from ..chat.tools import CallStream, ToolCall
from ..engines import EngineEvent
from ..generation import ClientGone, Generation, closing, sse, stream_error
from .protocol import (
    ResponsesRequest,
    function_call_item,
    message,
    message_id,
    output_logprobs,
    output_text,
    response_id,
    response_object,
)

if TYPE_CHECKING:
    from ..components import Components


class ResponsesServing:
    def __init__(self, c: Components) -> None:
        self.c = c

    async def create(self, request: Request, body: ResponsesRequest, t0: float) -> Response:
        c = self.c
        chat = body.to_chat()
        gen = Generation(c, request, t0)
        target = resolve_target(c, chat.model)
        messages = chat.chat_messages()
        prompt, tools = chat.template_input(c.engine.takes_tools)
        prompt_ids = await asyncio.to_thread(c.engine.encode_chat, prompt, tools)
        room = gen.room(len(prompt_ids), chat.requested_max_tokens, "input")
        sampling = chat.to_sampling_params(room, c.cfg.serving.default_max_tokens, c.vocab.size)
        param = _param(chat)
        await gen.prepare(sampling, param)
        decision = await gen.route(target, route_text(messages), chat.model, chat.expected_skill)
        rid, created = response_id(), time.time()
        try:
            stream = await gen.start(rid, prompt_ids, sampling, decision, constraint_param=param)
            headers = {"x-skillpool-route": decision.header()}
            if body.stream:
                events = self._events(rid, created, stream, body, chat, decision, len(prompt_ids))
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            [choice] = await gen.collect(stream, 1)
        except ClientGone:
            return Response(status_code=499)
        status = "incomplete" if choice.finish == "length" else "completed"
        lps = output_logprobs(c.vocab, choice.logprobs) if body.logprobs is not None else None
        text, calls = tool_calls(chat, choice.text)
        output = [message(message_id(), status, [output_text(text, lps)])] if text or not calls else []
        output += [function_call_item(call) for call in calls]
        used = {"input_tokens": len(prompt_ids), "output_tokens": choice.tokens}
        return JSONResponse(response_object(rid, body, created, status, output, decision, used), headers=headers)

    async def _events(
        self,
        rid: str,
        created: float,
        stream: AsyncIterator[EngineEvent],
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        d: Decision,
        n_prompt: int,
    ) -> AsyncIterator[str]:
        seq, mid, vocab = 0, message_id(), self.c.vocab
        keep_logprobs = body.logprobs is not None
        spec = chat.tool_spec
        calls = CallStream(spec) if spec is not None and spec.active else None
        items: list[dict[str, Any]] = []  # the function calls, output after the message

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **fields}, event=kind)

        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        yield event("response.created", response=response_object(rid, body, created, "in_progress", [], d))
        yield event("response.in_progress", response=response_object(rid, body, created, "in_progress", [], d))
        yield event("response.output_item.added", output_index=0, item=message(mid, "in_progress", []))
        yield event("response.content_part.added", **where, part=output_text("", [] if keep_logprobs else None))
        parts: list[str] = []
        logprobs: list[dict[str, Any]] = []
        finish, tokens = "stop", 0

        def pieces(out: list[str | ToolCall]) -> list[str]:
            """The text among `out`; its calls join `items`."""
            texts = []
            for piece in out:
                if isinstance(piece, str):
                    texts.append(piece)
                else:
                    items.append(function_call_item(piece))
            return texts

        try:
            async for ev in closing(stream):
                lps = output_logprobs(vocab, ev.logprobs) if keep_logprobs else []
                logprobs += lps
                texts = pieces(list(calls.push(ev.text))) if calls is not None else [ev.text]
                if ev.finish_reason is not None and calls is not None:
                    texts += pieces(list(calls.finish()))
                delta = "".join(texts)
                if delta or lps:
                    parts.append(delta)
                    yield event("response.output_text.delta", **where, delta=delta, logprobs=lps)
                finish, tokens = ev.finish_reason or finish, ev.tokens
        except Exception as e:  # headers are gone: the failure as the stream's own event
            err = stream_error(e)["error"]
            yield event("error", code=err["code"], message=err["message"], param=None)
            return
        text, status = "".join(parts), "incomplete" if finish == "length" else "completed"
        part = output_text(text, logprobs if keep_logprobs else None)
        item = message(mid, status, [part])
        yield event("response.output_text.done", **where, text=text, logprobs=logprobs)
        yield event("response.content_part.done", **where, part=part)
        yield event("response.output_item.done", output_index=0, item=item)
        for i, call in enumerate(items, start=1):  # each call as its own item, its arguments whole
            yield event("response.output_item.added", output_index=i, item={**call, "arguments": ""})
            at = {"item_id": call["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", **at, delta=call["arguments"])
            yield event("response.function_call_arguments.done", **at, arguments=call["arguments"])
            yield event("response.output_item.done", output_index=i, item=call)
        used = {"input_tokens": n_prompt, "output_tokens": tokens}
        final = response_object(rid, body, created, status, [item, *items], d, used)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)


def _param(chat: ChatCompletionRequest) -> str | None:
    """The Responses field a refused output constraint came from (text.format or tools)."""
    if chat.output is None:
        return None
    return "text.format" if chat.output.param.startswith("response_format") else "tools"
