"""POST /v1/chat/completions (OpenAI's chat API): strict JSON in, ChatCompletionRequest, ChatServing."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..components import components
from ..errors import read_json
from .protocol import ChatCompletionRequest, request_schema
from .serving import ChatServing

api = APIRouter()


# The body is read here, not declared as a parameter: FastAPI's own parsing would accept NaN and answer 422;
# read_json is strict and parse() answers in this API's envelope. The schema is declared for /docs and fuzzing.
@api.post(
    "/v1/chat/completions",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema()}}}},
)
async def create_chat_completion(request: Request) -> Response:
    t0 = time.perf_counter()
    body = ChatCompletionRequest.parse(await read_json(request))
    return await ChatServing(components(request)).create(request, body, t0)
