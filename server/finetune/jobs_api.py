"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, events and checkpoints (OpenAI's fine-tuning API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request

from skillpool.trainer.service import TERMINAL, Job

from ..auth import Principal, principal_of, require
from ..components import components
from ..errors import APIError
from .jobs_serving import checkpoints, create_job, events, to_openai, validate_and_queue
from .protocol import FineTuningJobCreate, page

if TYPE_CHECKING:
    from ..components import Components

api = APIRouter(prefix="/v1/fine_tuning/jobs")
# The handlers are plain functions: FastAPI runs them in its threadpool, so a slow job queue (Redis) never
# stalls the event loop that streams chat.


def _job(c: Components, job_id: str, caller: Principal) -> Job:
    job = c.jobs.get(job_id)
    if job is None or not caller.sees(job.owner):  # another key's job: as if there were none
        raise APIError(404, f"No fine-tuning job found with id {job_id!r}", "fine_tuning_job_id", "job_not_found")
    return job


@api.post("")
def create(request: Request, body: FineTuningJobCreate, background: BackgroundTasks) -> dict[str, Any]:
    c = components(request)
    caller = require(request, "train", "creating a fine-tuning job")
    for param, file_id in (("training_file", body.training_file), ("validation_file", body.validation_file)):
        f = c.files.get(file_id) if file_id is not None else None
        if f is not None and not caller.sees(f.owner):  # another key's file: as create_job says of a missing one
            raise APIError(400, f"invalid {param}: no such File object: {file_id}", param, "invalid_file")
    job, cfg = create_job(c, body, caller)
    background.add_task(validate_and_queue, c, job.id, cfg)  # a sync task: Starlette runs it in a thread
    return to_openai(job, c.base.model_id).model_dump()


@api.get("")
def list_jobs(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
    c = components(request)
    # the openai client sends metadata={"k": "v"} as metadata[k]=v; a job must carry every pair
    wanted = {k[len("metadata[") : -1]: v for k, v in request.query_params.items() if k.startswith("metadata[")}
    caller = principal_of(request)
    jobs = [to_openai(j, c.base.model_id) for j in c.jobs.list() if caller.sees(j.owner)]  # newest first
    jobs = [j for j in jobs if all((j.metadata or {}).get(k) == v for k, v in wanted.items())]
    return page(jobs, after, limit)


@api.get("/{job_id}")
def retrieve(request: Request, job_id: str) -> dict[str, Any]:
    c = components(request)
    return to_openai(_job(c, job_id, principal_of(request)), c.base.model_id).model_dump()


@api.post("/{job_id}/cancel")
def cancel(request: Request, job_id: str) -> dict[str, Any]:
    c = components(request)
    job = _job(c, job_id, require(request, "train", "cancelling a fine-tuning job"))
    if job.status in TERMINAL:
        raise APIError(409, f"Job {job_id} has already {job.status}", "fine_tuning_job_id", "job_finished")
    return to_openai(c.jobs.cancel(job_id) or job, c.base.model_id).model_dump()


@api.get("/{job_id}/events")
def list_events(
    request: Request, job_id: str, after: str | None = None, limit: int = Query(20, ge=1, le=1000)
) -> dict[str, Any]:
    return page(events(_job(components(request), job_id, principal_of(request))), after, limit)


@api.get("/{job_id}/checkpoints")
def list_checkpoints(
    request: Request, job_id: str, after: str | None = None, limit: int = Query(10, ge=1, le=100)
) -> dict[str, Any]:
    return page(checkpoints(_job(components(request), job_id, principal_of(request))), after, limit)
