"""vLLM's tokenizer endpoints, for the base model's tokenizer and chat template (every skill shares them):
POST /tokenize (a prompt, or chat messages through the template), POST /detokenize, GET /tokenizer_info.

Shapes are vLLM's: {"count", "max_model_len", "tokens", "token_strs"} and {"prompt"}; clients such as
lm-evaluation-harness tokenize through them when a server has them.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from .chat.protocol import ChatMessage
from .chat.target import resolve_target
from .components import components
from .errors import read_json
from .openai_request import api_error, inline_schema, invalid

api = APIRouter()
MAX_DETOKENIZE = 1_000_000  # ids in one /detokenize call


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        "model": "model must be a string",
        "prompt": "prompt must be a string",
        "messages": "messages must be a list of chat messages with text content",
    }

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = Field(
        default=None, description="default: true for a prompt, false for messages"
    )
    add_generation_prompt: StrictBool = Field(default=True, description="messages: end with the assistant's turn")
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _one(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object", None, "invalid_json")
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise invalid("give either prompt or messages", "prompt")
        return body


class DetokenizeRequest(BaseModel):
    FIELD_ERRORS: ClassVar[dict[str, str]] = {
        "model": "model must be a string",
        "tokens": f"tokens must be a list of at most {MAX_DETOKENIZE} token ids",
    }

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=MAX_DETOKENIZE)


def _parse(model: Any, body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise api_error(e.errors()[0], model.FIELD_ERRORS) from None


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}}


@api.post("/tokenize", openapi_extra=_body(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    c = components(request)
    body: TokenizeRequest = _parse(TokenizeRequest, await read_json(request))
    if body.model is not None:
        resolve_target(c, body.model)  # a model this server does not serve is a 404, as everywhere
    if body.messages is not None:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        text = await asyncio.to_thread(
            c.vocab.tokenizer.apply_chat_template,
            msgs,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
        )
        ids = await asyncio.to_thread(c.vocab.encode, text, bool(body.add_special_tokens))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(c.vocab.encode, body.prompt or "", special)
    strs = [c.vocab.token_text(t) for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": c.engine.max_context, "tokens": ids, "token_strs": strs})


@api.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    c = components(request)
    body: DetokenizeRequest = _parse(DetokenizeRequest, await read_json(request))
    if body.model is not None:
        resolve_target(c, body.model)
    if (bad := c.vocab.outside(body.tokens)) is not None:
        raise api_error(
            {"type": "invalid_value", "loc": ("tokens",), "msg": "", "input": bad, "ctx": {}},  # type: ignore[typeddict-item]
            {"tokens": f"tokens: {{input}} is not a token id of this model (0 to {c.vocab.size - 1})"},
        )
    return JSONResponse({"prompt": await asyncio.to_thread(c.vocab.decode, body.tokens)})


@api.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    return JSONResponse(components(request).vocab.info())
