"""POST /v1/responses (OpenAI's Responses API, stateless): strict JSON in, ResponsesRequest, ResponsesServing."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..components import components
from ..errors import read_json
from .protocol import ResponsesRequest, request_schema
from .serving import ResponsesServing

api = APIRouter()


# The body is read here, not declared as a parameter (chat/api_router.py says why); the schema is for /docs and fuzzing.
@api.post(
    "/v1/responses",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema()}}}},
)
async def create_response(request: Request) -> Response:
    t0 = time.perf_counter()
    body = ResponsesRequest.parse(await read_json(request))
    return await ResponsesServing(components(request)).create(request, body, t0)
