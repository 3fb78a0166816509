"""The import endpoints: POST /v1/skills/import (a PEFT LoRA and example requests become a skill, through a job as
an upload does), and vLLM's runtime adapter API: POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..components import components
from .serving import ImportServing, LoadLoRAAdapter, UnloadLoRAAdapter

api = APIRouter(prefix="/v1")


@api.post("/skills/import", status_code=202)
async def import_skill(request: Request) -> JSONResponse:
    return await ImportServing(components(request)).create(request)


@api.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoRAAdapter) -> PlainTextResponse:
    return await ImportServing(components(request)).load_lora(request, body)


@api.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapter) -> PlainTextResponse:
    return await ImportServing(components(request)).unload_lora(request, body)
