"""FastAPI app: the components, /healthz and /metrics; the chat, task, model, fine-tuning and admin routes
come from chat_api, tasks_api, models_api, finetune (files, jobs) and admin_api."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from skillpool.adapters_store.base_model import BaseModel
from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router
from skillpool.trainer.files import FileStore
from skillpool.trainer.jobs import JobQueue

from . import models_api
from .admin_api import install_admin
from .chat_api import install_chat
from .config import ServerConfig
from .engines import Engine
from .errors import install_handlers
from .finetune import files_api, jobs_api
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

    @cached_property
    def files(self) -> FileStore:
        """Uploaded training files, in the data dir that servers and workers share."""
        return FileStore(self.cfg.data_dir)

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

    app.add_middleware(AuthAndCount, api_key=c.cfg.api_key, metrics=m, admin_key=c.cfg.admin_key)

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

    install_chat(app, c)

    install_tasks(app, c)
    app.include_router(models_api.api)
    app.include_router(files_api.api)
    app.include_router(jobs_api.api)

    return app
