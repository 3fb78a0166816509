"""FastAPI app: /v1/chat/completions, /v1/models, /tasks, /healthz, /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import UploadFile

from skillpool.adapters_store.base_model import BaseModel
from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.adapters_store.store import SkillStore
from skillpool.router import Decision, Router
from skillpool.trainer.config import DEFAULT_METHOD, ConfigError, TrainConfig, method_error
from skillpool.trainer.datasets import DatasetError, parse_jsonl, route_text
from skillpool.trainer.jobs import Job, JobQueue, new_job_id

from .admin_api import install_admin
from .config import ServerConfig
from .engine_hf import GenEvent, HFEngine
from .errors import APIError, install_handlers
from .metrics import Metrics
from .openai_api import ChatParams, chat_chunk, chat_completion, completion_id, parse_chat_request, route_field
from .scheduler import Pending, QueueFull, Scheduler
from .skills import SkillPool

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: ServerConfig
    base: BaseModel
    store: SkillStore
    engine: HFEngine
    router: Router
    pool: SkillPool
    jobs: JobQueue
    scheduler: Scheduler
    metrics: Metrics
    started: float

    def close(self) -> None:
        self.scheduler.close()
        self.jobs.close()


def _target(c: Components, model: str) -> str:
    """'auto' routes; the base model id (or 'base') means no adapter; a skill name forces that skill."""
    if model == "auto":
        return "auto"
    if model in (c.base.model_id, "base"):
        return "base"
    if c.pool.get(model) is not None:
        return model
    raise APIError(
        404,
        f"The model '{model}' does not exist (use 'auto', '{c.base.model_id}' or a skill name)",
        "model",
        "model_not_found",
    )


def create_app(c: Components) -> FastAPI:
    app = FastAPI(title="skillpool", version="0.1.0")
    app.state.components = c
    install_handlers(app)
    install_admin(app, c.router, c.metrics)
    m = c.metrics

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if c.cfg.api_key and (path.startswith("/v1") or path.startswith("/tasks")):
            if request.headers.get("authorization") != f"Bearer {c.cfg.api_key}":
                return JSONResponse(
                    {
                        "error": {
                            "message": "invalid or missing API key",
                            "type": "authentication_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    },
                    status_code=401,
                )
        t0 = time.perf_counter()
        response: Response = await call_next(request)
        endpoint = request.scope.get("route").path if request.scope.get("route") else "unmatched"  # type: ignore[union-attr]
        m.requests.labels(endpoint, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            m.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    # --- health & metrics ---------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": c.base.model_id,
            "skills": len(c.pool.records()),
            "uptime_s": round(time.time() - c.started, 1),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        m.training_queue.set(c.jobs.depth())
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    # --- models -------------------------------------------------------------------------------
    def model_objects() -> list[dict[str, Any]]:
        created = int(c.started)
        out = [
            {"id": c.base.model_id, "object": "model", "created": created, "owned_by": "skillpool", "parent": None},
            {"id": "auto", "object": "model", "created": created, "owned_by": "skillpool", "parent": c.base.model_id},
        ]
        for rec in c.pool.records():
            out.append(
                {
                    "id": rec.name,
                    "object": "model",
                    "created": int(rec.meta.get("created", created)),
                    "owned_by": "skillpool",
                    "parent": c.base.model_id,
                    "version": rec.version,
                    "eval": rec.meta.get("eval"),
                }
            )
        return out

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model_objects()}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        for obj in model_objects():
            if obj["id"] == model_id:
                return obj
        raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")

    # --- chat ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", None, "invalid_json") from None
        params = parse_chat_request(body)
        target = _target(c, params.model)
        prompt_ids = c.engine.encode_chat(params.messages)
        room = c.engine.max_context - len(prompt_ids)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {c.engine.max_context} tokens; the messages use {len(prompt_ids)} "
                f"and max_tokens asks for {params.max_tokens}",
                "messages" if room < 1 else "max_tokens",
                "context_length_exceeded",
            )
        p = Pending(
            prompt_ids=prompt_ids,
            route_text=route_text(params.messages),
            target=target,
            max_tokens=params.max_tokens or min(room, c.cfg.default_max_tokens),
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
            loop=asyncio.get_running_loop(),
        )
        try:
            c.scheduler.submit(p)
        except QueueFull:
            raise APIError(
                503, "the server is busy: too many requests waiting, retry later", None, "server_busy"
            ) from None
        t0 = time.perf_counter()
        try:
            kind, decision = await p.events.get()
        except asyncio.CancelledError:
            p.cancelled.set()
            raise
        if kind == "error":
            raise APIError(500, f"generation failed: {decision}", None, "internal_error")
        headers = {"x-skillpool-route": decision.header()}
        m.tokens.labels("prompt").inc(len(prompt_ids))
        if params.stream:
            return StreamingResponse(_stream(p, params, decision, t0), media_type="text/event-stream", headers=headers)
        return await _complete(p, params, decision, t0, headers)

    async def _events(p: Pending, t0: float) -> AsyncIterator[GenEvent]:
        first: float | None = None
        try:
            while True:
                kind, ev = await p.events.get()
                if kind == "error":
                    raise ev
                if first is None and (ev.text or ev.finish_reason):
                    first = time.perf_counter()
                    m.ttft.observe(first - t0)
                yield ev
                if ev.finish_reason is not None:
                    if first is not None and ev.tokens > 1:
                        m.inter_token.observe((time.perf_counter() - first) / (ev.tokens - 1))
                    m.tokens.labels("completion").inc(ev.tokens)
                    m.request_seconds.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
                    return
        finally:
            p.cancelled.set()  # no-op when finished; stops the row if the client went away

    async def _complete(p: Pending, params: ChatParams, d: Decision, t0: float, headers: dict[str, str]) -> Response:
        parts: list[str] = []
        finish, ntok = "stop", 0
        async for ev in _events(p, t0):
            parts.append(ev.text)
            finish, ntok = ev.finish_reason or finish, ev.tokens
        usage = {
            "prompt_tokens": len(p.prompt_ids),
            "completion_tokens": ntok,
            "total_tokens": len(p.prompt_ids) + ntok,
        }
        return JSONResponse(
            chat_completion(completion_id(), params.model, "".join(parts), finish, usage, d), headers=headers
        )

    async def _stream(p: Pending, params: ChatParams, d: Decision, t0: float) -> AsyncIterator[str]:
        cid, created = completion_id(), int(time.time())

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        yield sse(
            chat_chunk(cid, params.model, created, {"role": "assistant", "content": ""}, skillpool=route_field(d))
        )
        ntok = 0
        try:
            async for ev in _events(p, t0):
                ntok = ev.tokens
                if ev.text:
                    yield sse(chat_chunk(cid, params.model, created, {"content": ev.text}))
                if ev.finish_reason is not None:
                    yield sse(chat_chunk(cid, params.model, created, {}, ev.finish_reason))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            log.exception("stream failed")
            yield sse(
                {
                    "error": {
                        "message": f"generation failed: {e}",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
                }
            )
            return
        if params.include_usage:
            usage = {
                "prompt_tokens": len(p.prompt_ids),
                "completion_tokens": ntok,
                "total_tokens": len(p.prompt_ids) + ntok,
            }
            yield sse(chat_chunk(cid, params.model, created, None, usage=usage))
        yield "data: [DONE]\n\n"

    # --- tasks --------------------------------------------------------------------------------
    @app.post("/tasks", status_code=202)
    async def create_task(request: Request) -> JSONResponse:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > c.cfg.max_upload_bytes + 64 * 1024:
            raise APIError(413, f"upload is larger than {c.cfg.max_upload_bytes} bytes", "file", "file_too_large")
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
        force_raw = form.get("force") or "false"
        if not isinstance(force_raw, str) or force_raw.lower() not in ("true", "false", "1", "0"):
            raise APIError(400, f"force must be true or false, got {force_raw!r}", "force", "invalid_force")
        force = force_raw.lower() in ("true", "1")
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
        if c.jobs.depth() >= c.cfg.max_pending_jobs:
            raise APIError(
                429, f"{c.jobs.depth()} training jobs are already pending; retry later", None, "too_many_jobs"
            )
        job = Job(
            id=new_job_id(),
            skill=name,
            method=method,
            config=cfg.to_dict(),
            status="validating",
            examples=len(examples),
            force=force,
        )
        c.jobs.submit(job, examples, cfg)
        return JSONResponse(job.to_dict(), status_code=202)

    @app.get("/tasks")
    async def list_tasks() -> dict[str, Any]:
        return {"object": "list", "data": [j.to_dict() for j in c.jobs.list()]}

    def _job(job_id: str) -> Job:
        job = c.jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no task with id {job_id!r}", "id", "task_not_found")
        return job

    @app.get("/tasks/{job_id}")
    async def get_task(job_id: str) -> dict[str, Any]:
        return _job(job_id).to_dict()

    @app.delete("/tasks/{job_id}")
    async def cancel_task(job_id: str) -> dict[str, Any]:
        job = _job(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            raise APIError(409, f"task {job_id} already {job.status}", "id", "task_finished")
        return (c.jobs.cancel(job_id) or job).to_dict()

    return app
