"""Health and metrics endpoints: GET /healthz (liveness: engine and routing alive; 503 otherwise), GET /readyz
(readiness, with each check; the trainer is named but does not gate it; 503 once the server is stopping), GET
/metrics, and vLLM's GET /health (an empty 200, or 503) and GET /version."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .components import components

api = APIRouter()


@api.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    c = components(request)
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


@api.get("/health")
async def health(request: Request) -> Response:
    """vLLM's liveness probe: an empty 200 while the engine and the routing stage live, else 503."""
    c = components(request)
    return Response(status_code=200 if c.engine.healthy() and c.routing.alive() else 503)


@api.get("/version")
async def server_version() -> JSONResponse:
    try:
        v = version("skillpool")
    except PackageNotFoundError:  # run from a source tree that was never installed
        v = "unknown"
    return JSONResponse({"version": v})


@api.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Readiness: may this replica take traffic? The engine thread alive, the routing stage alive and the
    base model loaded (components are built before the app serves). Redis is left out on purpose: chat
    keeps working without it, so a balancer must not drain the replica when only uploads are affected.
    For the same reason `trainer` (this server's trainer thread alive) is shown, and listed in `failing`
    when false, but never makes the replica unready; a server that runs no trainer (Redis workers train)
    has no `trainer` check. `accepting` turns false once the server is stopping (server/drain.py): it then
    takes no new requests, while liveness stays green for the drain."""
    c = components(request)
    checks = {
        "engine": c.engine.healthy(),
        "routing": c.routing.alive(),
        "model": c.engine.max_context > 0,
        "accepting": not request.app.state.drain.draining,
    }
    ready = all(checks.values())
    trainer = c.jobs.trainer_alive()
    if trainer is not None:
        checks["trainer"] = trainer
    failing = [k for k, ok in checks.items() if not ok]
    body = {"status": "ready" if ready else "not_ready", "checks": checks, "failing": failing}
    return JSONResponse(body, status_code=200 if ready else 503)


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    # the engine's and the job queue's series are read now (a Redis round trip): off the event loop
    text = await asyncio.to_thread(generate_latest, components(request).metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
