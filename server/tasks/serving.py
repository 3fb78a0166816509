"""Serving the training tasks: upload a JSONL dataset to learn as a skill (checked in this order: content
type, file, name, method, force, an existing skill, the caller's key, config, the dataset, the queue's room),
list them, get one, cancel one."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from skillpool.trainer.config import DEFAULT_METHOD, TrainConfig
from skillpool.trainer.datasets import DatasetError, parse_jsonl
from skillpool.trainer.service import TERMINAL, Example, Job

from ..auth import Principal, principal_of, require
from ..errors import APIError, parse_json
from ..intake import (
    TASKS,
    JobRequest,
    check_force,
    check_method,
    check_name,
    check_owner,
    exists_error,
    flag,
    hold_name,
    room,
    train_config,
)

if TYPE_CHECKING:
    from ..components import Components


class TaskServing:
    def __init__(self, c: Components) -> None:
        self.c = c

    async def create(self, request: Request) -> JSONResponse:
        """POST /tasks: a multipart upload (file, name, method, force, new_version, config) queued as a job."""
        c = self.c
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError(
                400,
                "POST /tasks takes multipart/form-data with fields 'file' (JSONL) and 'name'",
                None,
                "invalid_content_type",
            )
        form = await request.form(max_part_size=c.cfg.http.max_upload_bytes + 1)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "missing multipart field 'file' (a JSONL dataset)", "file", "missing_file")
        name = check_name(c, form.get("name"), TASKS)
        method = check_method(c, form.get("method") or DEFAULT_METHOD, TASKS)
        force = flag(form.get("force"), "force")
        check_force(principal_of(request), force, TASKS)
        new_version = flag(form.get("new_version"), "new_version")
        # a name that exists gets a new version only when asked: never overwrite someone's skill by accident
        existing = await asyncio.to_thread(c.store.versions, name)
        if existing and not new_version:
            raise exists_error(name, existing[-1].version, TASKS)
        caller = require(request, "train", "uploading a task")  # the middleware checked it too, by path
        if new_version:  # a train key extends only the skills it created
            await asyncio.to_thread(check_owner, c, caller, name, TASKS)
        raw_cfg = form.get("config")
        cfg_obj = (
            parse_json(raw_cfg, "config", "config", "invalid_config", constants=True)
            if isinstance(raw_cfg, str) and raw_cfg.strip()
            else {}
        )
        cfg = train_config(cfg_obj, TASKS, caller)
        data = await upload.read(c.cfg.http.max_upload_bytes + 1)
        if len(data) > c.cfg.http.max_upload_bytes:
            raise APIError(413, f"upload is larger than {c.cfg.http.max_upload_bytes} bytes", "file", "file_too_large")
        try:
            examples = await asyncio.to_thread(
                parse_jsonl, data, c.cfg.training.min_upload_examples, c.cfg.training.max_upload_examples
            )
        except DatasetError as e:
            raise APIError(
                400,
                str(e),
                "file",
                "invalid_dataset",
                errors=[{"line": x.line, "field": x.field, "message": x.message} for x in e.errors],
            ) from None
        job = JobRequest(name, method, force, cfg, caller.name, new_version, examples=len(examples)).job()
        job.log(f"Created training job: {job.id} (POST /tasks, {len(examples)} examples validated)")
        if existing:
            job.log(f"Skill {name} exists: this job trains version {existing[-1].version + 1} or later")
        # the queue calls go to a thread: a slow Redis must not stall the event loop (and every chat stream)
        await asyncio.to_thread(_reserve_and_submit, c, job, examples, cfg, new_version)
        return JSONResponse(job.to_dict(), status_code=202)

    def list_tasks(self, request: Request) -> dict[str, Any]:
        caller = principal_of(request)
        return {"object": "list", "data": [j.to_dict() for j in self.c.jobs.list() if caller.sees(j.owner)]}

    def _job(self, job_id: str, caller: Principal) -> Job:
        job = self.c.jobs.get(job_id)
        if job is None or not caller.sees(job.owner):  # another key's task: as if there were none
            raise APIError(404, f"no task with id {job_id!r}", "id", "task_not_found")
        return job

    def retrieve(self, request: Request, job_id: str) -> dict[str, Any]:
        return self._job(job_id, principal_of(request)).to_dict()

    def cancel(self, request: Request, job_id: str) -> dict[str, Any]:
        job = self._job(job_id, require(request, "train", "cancelling a task"))
        if job.status in TERMINAL:
            raise APIError(409, f"task {job_id} already {job.status}", "id", "task_finished")
        return (self.c.jobs.cancel(job_id) or job).to_dict()


def _reserve_and_submit(c: Components, job: Job, examples: list[Example], cfg: TrainConfig, new_version: bool) -> None:
    """Queue `job` holding its skill's name (intake.hold_name)."""

    def submit() -> None:
        existing = c.store.versions(job.skill)  # the job that held the name until a moment ago may have stored it
        if existing and not new_version:
            raise exists_error(job.skill, existing[-1].version, TASKS)
        c.jobs.submit(job, examples, cfg, room(c))

    hold_name(c, job, TASKS, new_version, submit)
