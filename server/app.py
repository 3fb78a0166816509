"""FastAPI app: the routes over the components (components.py), installed from health_api (/healthz, /metrics),
chat/, completions/, responses/, tokenize_api, tasks/, models_api (models, retire, rollback, export), imports/
(adapter imports, vLLM's adapter API), finetune (files, jobs) and admin_api; around them the request ids and the
access log (request_ids.py), the drain a stop begins, the checks of a request's text and size, and, when asked,
CORS."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from . import console_api, health_api, models_api, tokenize_api
from .admin_api import install_admin
from .auth import KeyRing
from .chat import api_router as chat_api
from .completions import api_router as completions_api
from .components import Components
from .config import allowed_origins
from .console import install_console
from .drain import Drain, DrainGate
from .errors import install_handlers
from .finetune import files_api, jobs_api
from .imports import api_router as imports_api
from .limits import BodyLimit
from .middleware import AuthAndCount
from .redirects import install_slash_redirects
from .request_ids import HEADER, RequestIds
from .request_text import RequestText
from .responses import api_router as responses_api
from .tasks import api_router as tasks_api

log = logging.getLogger(__name__)


def create_app(c: Components, keys: KeyRing | None = None) -> FastAPI:
    """`keys`: the keys in force (`skillpool serve` passes the ring its SIGHUP handler reloads); default: c.cfg's."""
    app = FastAPI(title="skillpool", version="0.1.0")
    app.state.components = c
    app.state.keys = keys = keys if keys is not None else KeyRing.from_config(c.cfg)
    exposed = not keys.keys and c.cfg.http.host not in (
        "127.0.0.1",
        "localhost",
        "::1",
    )  # anyone on the network may train
    log.log(logging.WARNING if exposed else logging.INFO, "%s", keys.summary())
    install_handlers(app)
    install_slash_redirects(app)  # /console/ -> /console, relative: never to the Host a request names
    install_admin(app, c.router, c.metrics)
    install_console(app)  # the web page at /console, over the APIs below
    app.state.drain = drain = Drain()  # the requests in flight, and the drain a stop begins (server/stopping.py)
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(RequestText)  # inside the body limit: what it reads is bounded, and the caller known
    app.add_middleware(BodyLimit, upload_bytes=c.cfg.http.max_upload_bytes, request_bytes=c.cfg.http.max_request_bytes)
    app.add_middleware(AuthAndCount, keys=keys, metrics=c.metrics, templates=lambda: list(app.openapi()["paths"]))
    if origins := allowed_origins(c.cfg.http.allowed_origins):  # outside the keys: a preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[HEADER.decode(), "x-skillpool-route", "retry-after"],
        )
    app.add_middleware(RequestIds)  # outermost: every response has its id, refusals and preflights too

    app.include_router(health_api.api)
    app.include_router(chat_api.api)
    app.include_router(completions_api.api)
    app.include_router(responses_api.api)
    app.include_router(tokenize_api.api)
    app.include_router(tasks_api.api)
    app.include_router(models_api.api)
    app.include_router(imports_api.api)
    app.include_router(files_api.api)
    app.include_router(jobs_api.api)
    app.include_router(console_api.api)

    return app
