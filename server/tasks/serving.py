"""Serving the training tasks: upload a JSONL dataset to learn as a skill (checked in this order: content
type, file, name, method, force, an existing skill, the caller's key, config, the dataset, the queue's room),
list them, get one, cancel one."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.trainer.config import DEFAULT_METHOD, TrainConfig
from skillpool.trainer.datasets import DatasetError, parse_jsonl
from skillpool.trainer.service import TERMINAL, Example, Job

from ..auth import Principal, principal_of, require
from ..errors import APIError, parse_json
from ..intake import TASKS, JobRequest, check_force, check_method, hold_name, room, train_config

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
        method = check_method(c, form.get("method") or DEFAULT_METHOD, TASKS)
        force = _flag(form.get("force"), "force")
        check_force(principal_of(request), force, TASKS)
        new_version = _flag(form.get("new_version"), "new_version")
        # a name that exists gets a new version only when asked: never overwrite someone's skill by accident
        existing = await asyncio.to_thread(c.store.versions, name)
        if existing and not new_version:
            raise _exists(name, existing[-1].version)
        caller = require(request, "train", "uploading a task")  # the middleware checked it too, by path
        if new_version and not caller.can("admin"):  # a train key extends only the skills it created
            found, creator = await asyncio.to_thread(_creator, c, name)
            if found and creator != caller.name:
                raise APIError(
                    403,
                    f"skill {name!r} was created by another key: a new version needs that key or the admin",
                    "name",
                    "permission_denied",
                )
        raw_cfg = form.get("config")
        cfg_obj = (
            parse_json(raw_cfg, "config", "config", "invalid_config", constants=True)
            if isinstance(raw_cfg, str) and raw_cfg.strip()
            else {}
        )
        cfg = train_config(cfg_obj, TASKS, caller)
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


def _creator(c: Components, name: str) -> tuple[bool, str | None]:
    """(whether skill `name` exists or is being trained, the name of the key that created it). The creator
    is the owner of its first stored version, or before one is stored, of its oldest unfinished job."""
    versions = c.store.versions(name)
    if versions:
        return True, versions[0].meta.get("owner")
    pending = [j for j in c.jobs.list() if j.skill == name and j.status not in TERMINAL]
    return (True, min(pending, key=lambda j: j.created_at).owner) if pending else (False, None)


def _exists(name: str, version: int) -> APIError:
    return APIError(
        409,
        f"skill {name!r} exists (version {version}); send new_version=true to train version {version + 1}, or "
        "choose another name",
        "name",
        "skill_exists",
    )


def _reserve_and_submit(c: Components, job: Job, examples: list[Example], cfg: TrainConfig, new_version: bool) -> None:
    """Queue `job` holding its skill's name (intake.hold_name)."""

    def submit() -> None:
        existing = c.store.versions(job.skill)  # the job that held the name until a moment ago may have stored it
        if existing and not new_version:
            raise _exists(job.skill, existing[-1].version)
        c.jobs.submit(job, examples, cfg, room(c))

    hold_name(c, job, TASKS, new_version, submit)


def _flag(raw: object, field: str) -> bool:
    """A multipart boolean: true/false/1/0, absent is false."""
    value = raw or "false"
    if not isinstance(value, str) or value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{field} must be true or false, got {value!r}", field, f"invalid_{field}")
    return value.lower() in ("true", "1")
