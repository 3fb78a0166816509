"""OpenAI model listing: GET /v1/models and GET /v1/models/{id} — the base model, `auto` (routed), and
every registered skill with its version and held-out evaluation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from .errors import APIError

if TYPE_CHECKING:
    from .app import Components


def model_objects(c: Components) -> list[dict[str, Any]]:
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


def install_models(app: FastAPI, c: Components) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model_objects(c)}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        for obj in model_objects(c):
            if obj["id"] == model_id:
                return obj
        raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
