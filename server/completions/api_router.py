"""POST /v1/completions (OpenAI's legacy completions): strict JSON in, CompletionRequest, CompletionServing."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..components import components
from ..errors import read_json
from .protocol import CompletionRequest, request_schema
from .serving import CompletionServing

api = APIRouter()


# The body is read here, not declared as a parameter (chat/api_router.py says why); the schema is for /docs and fuzzing.
@api.post(
    "/v1/completions",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema()}}}},
)
async def create_completion(request: Request) -> Response:
    t0 = time.perf_counter()
    body = CompletionRequest.parse(await read_json(request))
    return await CompletionServing(components(request)).create(request, body, t0)
