"""Serving adapter imports: POST /v1/skills/import (multipart: name, adapter or adapter_path, examples, force,
new_version), and vLLM's runtime adapter API, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, mapped onto
an import and a retire.

An import is checked whole before anything is stored, in this order: the request's fields, the name, force,
new_version against the store, the caller's key and ownership, the examples, the adapter (its archive or path, then
lora.peft_checks against the base model), the queue's room. Only then is the checked adapter staged under the job's
id (adapters_store: tmp/, swept with its owner) and the job queued, method "imported", holding the skill's name as an
upload's job does: the trainer builds the router keys from the examples, runs the quality gate and writes the version.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.datastructures import UploadFile

from skillpool.lora.adapter import AdapterRejected
from skillpool.lora.peft_archive import read_tar
from skillpool.lora.peft_checks import MAX_RANK, CheckedAdapter, check_peft_files
from skillpool.runtime.base_model import linear_shapes
from skillpool.trainer.config import IMPORTED, TrainConfig
from skillpool.trainer.datasets import DatasetError, parse_jsonl
from skillpool.trainer.service import TERMINAL, Example, Job, JobStatus

from ..auth import Principal, principal_of, require
from ..errors import APIError
from ..intake import (
    IMPORT,
    LOAD_LORA,
    Fields,
    JobRequest,
    check_force,
    check_name,
    check_owner,
    exists_error,
    flag,
    hold_name,
    room,
)
from ..models_api import retire
from .sources import read_path

if TYPE_CHECKING:
    from ..components import Components

FORM_FIELDS = ("name", "adapter", "adapter_path", "examples", "force", "new_version")
POLL_S = 0.25  # how often a load_lora_adapter call looks at its job


class LoadLoRAAdapter(BaseModel):
    """vLLM's LoadLoRAAdapterRequest, with skillpool's `examples` (the router's keys) and `force` (the gate)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # vLLM: replace an adapter of that name; here: a new version of the skill
    is_3d_lora_weight: StrictBool = False
    examples: list[dict[str, Any]] | None = None
    force: StrictBool = False


class UnloadLoRAAdapter(BaseModel):
    """vLLM's UnloadLoRAAdapterRequest."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


@dataclass
class ImportPlan:
    """One import, checked up to its adapter: what the job is made of."""

    name: str
    files: dict[str, bytes]
    source: str  # where the adapter came from, for the job and the skill's meta (no server path)
    param: str  # the request field the adapter came in: its errors name it
    examples: list[Example]
    force: bool
    new_version: bool
    caller: Principal
    fields: Fields


class ImportServing:
    def __init__(self, c: Components) -> None:
        self.c = c

    async def create(self, request: Request) -> JSONResponse:
        """POST /v1/skills/import: answers 202 with the import job (followed at GET /tasks/{id}, as an upload's)."""
        c = self.c
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(
                400,
                "POST /v1/skills/import takes multipart/form-data with fields 'name', 'adapter' (a tar or tar.gz of a "
                "PEFT LoRA folder) and 'examples' (JSONL)",
                None,
                "invalid_content_type",
            )
        form = await request.form(max_part_size=c.cfg.http.max_upload_bytes + 1)
        unknown = sorted(set(form.keys()) - set(FORM_FIELDS))
        if unknown:
            raise APIError(
                400,
                f"unknown field {unknown[0]!r}: an import takes {', '.join(FORM_FIELDS)}",
                unknown[0],
                "unknown_field",
            )
        name = check_name(c, form.get("name"), IMPORT)
        force = flag(form.get("force"), "force")
        check_force(principal_of(request), force, IMPORT)
        new_version = flag(form.get("new_version"), "new_version")
        existing = await asyncio.to_thread(c.store.versions, name)
        if existing and not new_version:
            raise exists_error(name, existing[-1].version, IMPORT, "import")
        caller = require(request, "train", "importing an adapter")  # the middleware checked it too, by path
        if new_version:
            await asyncio.to_thread(check_owner, c, caller, name, IMPORT)
        upload = form.get("examples")
        if not isinstance(upload, UploadFile):
            raise APIError(
                400,
                "missing multipart field 'examples' (a JSONL of the requests it answers)",
                "examples",
                "missing_examples",
            )
        examples = await asyncio.to_thread(self._examples, await upload.read(c.cfg.http.max_upload_bytes + 1))
        adapter, path = form.get("adapter"), form.get("adapter_path")
        if isinstance(adapter, UploadFile) and path:
            raise APIError(
                400, "send the adapter as 'adapter' or 'adapter_path', not both", "adapter_path", "invalid_value"
            )
        if isinstance(adapter, UploadFile):
            data = await adapter.read(c.cfg.http.max_upload_bytes + 1)
            files = await asyncio.to_thread(_rejected_as_400, read_tar, "adapter", data, c.cfg.http.max_upload_bytes)
            source, param = "upload", "adapter"
        elif isinstance(path, str) and path:
            files, source = await asyncio.to_thread(self._read_path, path, "adapter_path")
            param = "adapter_path"
        elif new_version and (serving := await asyncio.to_thread(c.store.serving, name)) is not None:
            files = await asyncio.to_thread(serving.adapter_files)  # new keys for the adapter that serves
            source, param = f"version {serving.version} of {name}", "examples"
        else:
            raise APIError(
                400,
                "missing multipart field 'adapter' (a tar or tar.gz of a PEFT LoRA folder) or 'adapter_path'",
                "adapter",
                "missing_adapter",
            )
        plan = ImportPlan(name, files, source, param, examples, force, new_version, caller, IMPORT)
        job = await self._submit(plan, "POST /v1/skills/import")
        return JSONResponse(job.to_dict(), status_code=202)

    async def load_lora(self, request: Request, body: LoadLoRAAdapter) -> PlainTextResponse:
        """vLLM's POST /v1/load_lora_adapter: an import from a server path, answered once its job has ended."""
        c = self.c
        if body.is_3d_lora_weight:
            raise APIError(
                400, "3-D (mixture of experts) LoRA weights are not served", "is_3d_lora_weight", "invalid_value"
            )
        if body.lora_name in ("auto", "base", c.base.model_id):
            raise APIError(
                400,
                f"The lora adapter '{body.lora_name}' conflicts with a served base model.",
                "lora_name",
                "invalid_name",
            )
        name = check_name(c, body.lora_name, LOAD_LORA)
        check_force(principal_of(request), body.force, LOAD_LORA)
        existing = await asyncio.to_thread(c.store.versions, name)
        if existing and not body.load_inplace:  # vLLM's answer: a 400 that points at load_inplace
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
                "'load_inplace' to True.",
                "lora_name",
                "skill_exists",
            )
        caller = require(request, "train", "loading an adapter")
        if body.load_inplace:
            await asyncio.to_thread(check_owner, c, caller, name, LOAD_LORA)
        examples: list[Example] = []
        if body.examples is not None:
            lines = "\n".join(json.dumps(row) for row in body.examples).encode()
            examples = await asyncio.to_thread(self._examples, lines, "examples")
        files, source = await asyncio.to_thread(self._read_path, body.lora_path, "lora_path")
        plan = ImportPlan(name, files, source, "lora_path", examples, body.force, body.load_inplace, caller, LOAD_LORA)
        job = await self._submit(plan, "POST /v1/load_lora_adapter")
        done = await self._ended(job.id)
        if done.status == JobStatus.SUCCEEDED:
            headers = {"x-skillpool-job": job.id}
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.", headers=headers)
        if done.status == JobStatus.CANCELLED:
            raise APIError(409, f"import job {job.id} was cancelled", "lora_name", "job_cancelled")
        gate = done.error_code == "quality_gate_failed"
        raise APIError(
            400 if gate else 500,
            f"import job {job.id} failed: {done.error}",
            "examples" if gate else None,
            done.error_code,
        )

    async def unload_lora(self, request: Request, body: UnloadLoRAAdapter) -> PlainTextResponse:
        """vLLM's POST /v1/unload_lora_adapter: retire the skill (admin), every version kept for a rollback."""
        c = self.c
        if body.lora_int_id is not None:
            raise APIError(
                400, "skills have no integer LoRA ids here: unload by lora_name alone", "lora_int_id", "invalid_value"
            )
        name = c.pool.resolve(body.lora_name)
        if name is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name", "model_not_found")
        require(request, "admin", "unloading an adapter (retiring its skill)")
        await retire(c, name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # --- the steps -------------------------------------------------------------------------------------------
    def _examples(self, data: bytes, param: str = "examples") -> list[Example]:
        cfg = self.c.cfg
        if len(data) > cfg.http.max_upload_bytes:
            raise APIError(413, f"examples are larger than {cfg.http.max_upload_bytes} bytes", param, "file_too_large")
        try:
            return parse_jsonl(
                data, cfg.training.min_upload_examples, cfg.training.max_upload_examples, answers_optional=True
            )
        except DatasetError as e:
            errors = [{"line": x.line, "field": x.field, "message": x.message} for x in e.errors]
            raise APIError(400, str(e), param, "invalid_examples", errors=errors) from None

    def _read_path(self, raw: str, param: str) -> tuple[dict[str, bytes], str]:
        cfg = self.c.cfg
        return _rejected_as_400(read_path, param, raw, cfg.http.allowed_adapter_paths, cfg.http.max_upload_bytes, param)

    def _check(self, files: dict[str, bytes], param: str) -> CheckedAdapter:
        """lora.peft_checks against this base model, with the rank limit of the engine that serves it."""
        c = self.c
        if c.cfg.serving.engine == "vllm":
            limit, why = c.cfg.serving.max_lora_rank, " (--max-lora-rank)"
        else:
            limit, why = MAX_RANK, " (the largest rank skillpool serves)"
        linears = linear_shapes(str(c.base.path))
        return _rejected_as_400(check_peft_files, param, files, linears, limit, c.base.model_id, why)

    async def _submit(self, plan: ImportPlan, via: str) -> Job:
        checked = await asyncio.to_thread(self._check, plan.files, plan.param)
        cfg = TrainConfig()  # no hyperparameter trains anything; the gate's and the split's are the defaults
        job = JobRequest(
            plan.name, IMPORTED, plan.force, cfg, plan.caller.name, plan.new_version, examples=len(plan.examples)
        ).job()
        job.adapter = {**checked.summary(), "source": plan.source}
        job.log(f"Created import job: {job.id} ({via}, a rank-{checked.rank} LoRA, {len(plan.examples)} examples)")
        await asyncio.to_thread(self._stage_and_submit, job, checked, plan, cfg)
        return job

    def _stage_and_submit(self, job: Job, checked: CheckedAdapter, plan: ImportPlan, cfg: TrainConfig) -> None:
        """Stage the checked adapter under the job's id and queue the job, holding the skill's name
        (intake.hold_name); a job that cannot be queued leaves nothing staged."""
        c = self.c

        def submit() -> None:
            existing = c.store.versions(job.skill)  # the job that held the name until a moment ago may have stored it
            if existing and not plan.new_version:
                raise exists_error(job.skill, existing[-1].version, plan.fields, "import")
            c.store.stage(job.id, lambda folder: checked.save(folder, c.base.model_id))
            try:
                c.jobs.submit(job, plan.examples, cfg, room(c))
            except BaseException:
                c.store.unstage(job.id)
                raise

        hold_name(c, job, plan.fields, plan.new_version, submit)

    async def _ended(self, job_id: str) -> Job:
        while True:
            job = await asyncio.to_thread(self.c.jobs.get, job_id)
            if job is None:
                raise APIError(500, f"import job {job_id} is gone from the job queue", None, "import_failed")
            if job.status in TERMINAL:
                return job
            await asyncio.sleep(POLL_S)


def _rejected_as_400(fn: Any, param: str, *args: Any) -> Any:
    """fn(*args), an AdapterRejected from it answered as a 400 naming `param` with the check's code."""
    try:
        return fn(*args)
    except AdapterRejected as e:
        raise APIError(400, str(e), param, e.code) from None
