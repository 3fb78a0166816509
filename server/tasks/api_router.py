"""The training-task endpoints: POST /tasks (upload a JSONL dataset to learn as a skill), GET /tasks,
GET /tasks/{id} and DELETE /tasks/{id} (cancel)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..components import components
from .serving import TaskServing

api = APIRouter(prefix="/tasks")
# The reads and the cancel are plain functions: FastAPI runs them in its threadpool, so a slow job queue
# (Redis) never stalls the event loop that streams chat.


@api.post("", status_code=202)
async def create_task(request: Request) -> JSONResponse:
    return await TaskServing(components(request)).create(request)


@api.get("")
def list_tasks(request: Request) -> dict[str, Any]:
    return TaskServing(components(request)).list_tasks(request)


@api.get("/{job_id}")
def get_task(request: Request, job_id: str) -> dict[str, Any]:
    return TaskServing(components(request)).retrieve(request, job_id)


@api.delete("/{job_id}")
def cancel_task(request: Request, job_id: str) -> dict[str, Any]:
    return TaskServing(components(request)).cancel(request, job_id)
