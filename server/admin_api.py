"""Admin endpoints: fallback demand clusters (requests no skill serves yet, router.demand). They show the
text of other callers' requests: admin keys only (server.auth)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request

from skillpool.router import Router

from .auth import require
from .components import components
from .metrics import Metrics

api = APIRouter()


@api.get("/v1/skillpool/fallback_clusters")
async def fallback_clusters(request: Request, min_size: float = Query(0.0, ge=0.0)) -> dict[str, Any]:
    """Clusters of recent fallback requests, heaviest first: decayed size, count, examples, nearest skills."""
    require(request, "admin", "the fallback clusters (they show request text)")
    router = components(request).router
    data = router.demand.snapshot(router.nearest_skills, min_weight=min_size)
    return {
        "object": "list",
        "data": data,
        "observed": router.demand.observed,
        "settings": asdict(router.demand.settings),
    }


def install_admin(app: FastAPI, router: Router, metrics: Metrics) -> None:
    """Mount the admin routes; the demand gauges read the clusters when /metrics is scraped."""
    app.include_router(api)
    metrics.fallback_clusters.set_function(lambda: float(len(router.demand)))
    metrics.fallback_largest_cluster.set_function(
        lambda: max((row["size"] for row in router.demand.snapshot()), default=0.0)
    )
