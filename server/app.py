"""FastAPI app: the components, /v1/models, /healthz and /metrics; the chat, task and admin routes are
installed from chat_api, tasks_api and admin_api."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from skillpool.adapters_store.base_model import BaseModel
from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router
from skillpool.trainer.jobs import JobQueue

from .admin_api import install_admin
from .chat_api import install_chat
from .config import ServerConfig
from .engines import Engine
from .errors import APIError, install_handlers
from .metrics import Metrics
from .middleware import AuthAndCount
from .routing import RoutingStage
from .skills import SkillPool
from .tasks_api import install_tasks

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: ServerConfig
    base: BaseModel
    store: SkillStore
    engine: Engine
    router: Router
    pool: SkillPool
    jobs: JobQueue
    routing: RoutingStage
    metrics: Metrics
    started: float

    def close(self) -> None:
        self.routing.close()
        self.jobs.close()
        self.engine.close()


def create_app(c: Components) -> FastAPI:
    app = FastAPI(title="skillpool", version="0.1.0")
    app.state.components = c
    install_handlers(app)
    install_admin(app, c.router, c.metrics)
    m = c.metrics

    app.add_middleware(AuthAndCount, api_key=c.cfg.api_key, metrics=m)

    # --- health & metrics ---------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = c.engine.healthy() and c.routing.alive()
        body = {
            "status": "ok" if ok else "unhealthy",
            "model": c.base.model_id,
            "engine": c.engine.name,
            "skills": len(c.pool.records()),
            "uptime_s": round(time.time() - c.started, 1),
            **c.engine.stats(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        m.training_queue.set(c.jobs.depth())
        stats = c.engine.stats()
        m.queue_depth.set(stats["waiting"])
        m.running.set(stats["running"])
        m.resident_skills.set(stats["resident_skills"])
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

    install_chat(app, c)

    install_tasks(app, c)

    return app
