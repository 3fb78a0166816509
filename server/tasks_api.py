"""Training-task endpoints: POST /tasks (upload a JSONL dataset to learn as a skill), GET /tasks,
GET /tasks/{id} and DELETE /tasks/{id} (cancel)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.trainer.config import DEFAULT_METHOD, ConfigError, TrainConfig, method_error
from skillpool.trainer.datasets import DatasetError, parse_jsonl
from skillpool.trainer.jobs import Job, new_job_id
from skillpool.trainer.records import TERMINAL, JobStatus

from .errors import APIError
from .middleware import is_admin

if TYPE_CHECKING:
    from .app import Components


def install_tasks(app: FastAPI, c: Components) -> None:
    @app.post("/tasks", status_code=202)
    async def create_task(request: Request) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError(
                400,
                "POST /tasks takes multipart/form-data with fields 'file' (JSONL) and 'name'",
                None,
                "invalid_content_type",
            )
        form = await request.form(max_part_size=c.cfg.max_upload_bytes + 1)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "missing multipart field 'file' (a JSONL dataset)", "file", "missing_file")
        name_raw = form.get("name")
        if not isinstance(name_raw, str):
            raise APIError(400, "missing multipart field 'name' (the skill name)", "name", "missing_name")
        try:
            name = validate_skill_name(name_raw)
        except InvalidSkillName as e:
            raise APIError(400, str(e), "name", "invalid_name") from None
        if name == c.base.model_id:
            raise APIError(400, f"skill name {name!r} is the base model's id", "name", "invalid_name")
        method = form.get("method") or DEFAULT_METHOD
        if not isinstance(method, str) or (problem := method_error(method, c.router.settings.mode)):
            raise APIError(400, problem or "method must be a string", "method", "invalid_method")
        force = _flag(form.get("force"), "force")
        if force and not is_admin(request.headers, c.cfg.admin_key):  # as metadata.force on /v1/fine_tuning/jobs
            raise APIError(403, "force (register past the quality gate) is for the admin", "force", "permission_denied")
        new_version = _flag(form.get("new_version"), "new_version")
        # a name that exists gets a new version only when asked: never overwrite someone's skill by accident
        existing = await asyncio.to_thread(c.store.versions, name)
        if existing and not new_version:
            raise APIError(
                409,
                f"skill {name!r} exists (version {existing[-1].version}); send new_version=true to train version "
                f"{existing[-1].version + 1}, or choose another name",
                "name",
                "skill_exists",
            )
        raw_cfg = form.get("config")
        try:
            cfg_obj = json.loads(raw_cfg) if isinstance(raw_cfg, str) and raw_cfg.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(400, f"config is not valid JSON: {e.msg}", "config", "invalid_config") from None
        if not isinstance(cfg_obj, dict):
            raise APIError(400, "config must be a JSON object of hyperparameters", "config", "invalid_config")
        try:
            cfg = TrainConfig.from_dict(cfg_obj)
        except ConfigError as e:
            raise APIError(400, str(e), e.param, "invalid_config") from None
        data = await upload.read(c.cfg.max_upload_bytes + 1)
        if len(data) > c.cfg.max_upload_bytes:
            raise APIError(413, f"upload is larger than {c.cfg.max_upload_bytes} bytes", "file", "file_too_large")
        try:
            examples = await asyncio.to_thread(parse_jsonl, data, c.cfg.min_upload_examples, c.cfg.max_upload_examples)
        except DatasetError as e:
            raise APIError(
                400,
                str(e),
                "file",
                "invalid_dataset",
                errors=[{"line": x.line, "field": x.field, "message": x.message} for x in e.errors],
            ) from None
        # the queue calls go to a thread: a slow Redis must not stall the event loop (and every chat stream)
        if (pending := await asyncio.to_thread(c.jobs.depth)) >= c.cfg.max_pending_jobs:
            raise APIError(429, f"{pending} training jobs are already pending; retry later", None, "too_many_jobs")
        job = Job(
            id=new_job_id(),
            skill=name,
            method=method,
            config=cfg.to_dict(),
            status=JobStatus.VALIDATING,
            examples=len(examples),
            force=force,
        )
        job.log(f"Created training job: {job.id} (POST /tasks, {len(examples)} examples validated)")
        if existing:
            job.log(f"Skill {name} exists: this job trains version {existing[-1].version + 1} or later")
        await asyncio.to_thread(c.jobs.submit, job, examples, cfg)
        return JSONResponse(job.to_dict(), status_code=202)

    @app.get("/tasks")
    def list_tasks() -> dict[str, Any]:
        return {"object": "list", "data": [j.to_dict() for j in c.jobs.list()]}

    def _job(job_id: str) -> Job:
        job = c.jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no task with id {job_id!r}", "id", "task_not_found")
        return job

    @app.get("/tasks/{job_id}")
    def get_task(job_id: str) -> dict[str, Any]:
        return _job(job_id).to_dict()

    @app.delete("/tasks/{job_id}")
    def cancel_task(job_id: str) -> dict[str, Any]:
        job = _job(job_id)
        if job.status in TERMINAL:
            raise APIError(409, f"task {job_id} already {job.status}", "id", "task_finished")
        return (c.jobs.cancel(job_id) or job).to_dict()


def _flag(raw: object, field: str) -> bool:
    """A multipart boolean: true/false/1/0, absent is false."""
    value = raw or "false"
    if not isinstance(value, str) or value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{field} must be true or false, got {value!r}", field, f"invalid_{field}")
    return value.lower() in ("true", "1")
