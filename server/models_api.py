"""/v1/models and the skill lifecycle: list and retrieve (with a skill's versions and quality report),
DELETE retires a skill, POST …/rollback serves an earlier version again (admin).

Retire and rollback write the shared store's state first (adapters_store: nothing is deleted), act on this
server, then publish an event on the skill-event bus (trainer.bus) so that every other server follows without
a restart; a server that was down reads the same state when it starts.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, StrictInt

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.adapters_store.store import SkillRecord, UnreadableVersion
from skillpool.trainer.events import SkillActivated, SkillRetired

from .auth import require
from .components import components
from .errors import APIError

if TYPE_CHECKING:
    from .components import Components

api = APIRouter(prefix="/v1/models")


class Rollback(BaseModel):
    version: StrictInt | None = None  # None: the newest stored version; strict: `true` is not version 1


def _not_found(model_id: str) -> APIError:
    return APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")


def _skill_object(c: Components, rec: SkillRecord) -> dict[str, Any]:
    alias = rec.meta.get("fine_tuned_model")
    return {
        "id": alias or rec.name,
        "object": "model",
        "created": int(rec.meta.get("created", c.started)),
        "owned_by": "skillpool",
        "parent": c.base.model_id,
        "skill": rec.name,
        "version": rec.version,
        "eval": rec.meta.get("eval"),
        "method": (rec.meta.get("training") or {}).get("method"),
        "owner": rec.meta.get("owner"),  # the key name that trained it: it (or the admin) may add a version
    }


def model_objects(c: Components) -> list[dict[str, Any]]:
    created = int(c.started)
    return [
        {"id": c.base.model_id, "object": "model", "created": created, "owned_by": "skillpool", "parent": None},
        {"id": "auto", "object": "model", "created": created, "owned_by": "skillpool", "parent": c.base.model_id},
        *(_skill_object(c, rec) for rec in c.pool.records()),
    ]


def stored_skill(model_id: str) -> str | None:
    """The skill name a model id names in the store, served or not: a skill name, or a fine-tuning job's
    `ft:<base>:<suffix>:<short>` (its skill is `<suffix or ft>-<short>`, server.finetune.jobs_serving)."""
    name = model_id
    if model_id.startswith("ft:"):
        parts = model_id.split(":")
        if len(parts) != 4:
            return None
        name = f"{parts[2] or 'ft'}-{parts[3]}"
    try:
        return validate_skill_name(name)
    except InvalidSkillName:
        return None


def _versions(c: Components, name: str) -> dict[str, Any]:
    serving = c.store.serving(name)
    return {
        "versions": [
            {
                "version": r.version,
                "created": int(r.meta.get("created", 0)),
                "serving": serving is not None and r.version == serving.version,
                "eval": r.meta.get("eval"),
                "training": r.meta.get("training"),
                "samples": r.meta.get("samples"),  # rows: total, train, eval (held out), replay, probe
            }
            for r in c.store.versions(name)
        ],
        "quality": serving.meta.get("quality") if serving else None,
        "state": c.store.state(name),
    }


@api.get("")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": model_objects(components(request))}


@api.get("/{model_id}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    c = components(request)
    name = c.pool.resolve(model_id)
    if name is not None and (rec := c.pool.get(name)) is not None:
        return {**_skill_object(c, rec), **_versions(c, name)}
    for obj in model_objects(c)[:2]:
        if obj["id"] == model_id:
            return obj
    raise _not_found(model_id)


@api.delete("/{model_id}")
async def retire_model(request: Request, model_id: str) -> dict[str, Any]:
    """Retire a skill: no longer routed, forced or listed; its versions stay in the store for a rollback."""
    c = components(request)
    if model_id in (c.base.model_id, "auto", "base"):
        raise APIError(400, f"'{model_id}' is not a skill and cannot be deleted", "model", "invalid_value")
    name = c.pool.resolve(model_id)
    if name is None:
        raise _not_found(model_id)
    require(request, "admin", "deleting a model")
    c.store.retire(name)
    c.pool.unregister(name)
    await asyncio.to_thread(c.bus.publish, SkillRetired(name))
    return {"id": model_id, "object": "model", "deleted": True}


@api.post("/{model_id}/rollback")
async def rollback_model(request: Request, model_id: str, body: Rollback | None = None) -> dict[str, Any]:
    """Serve a stored version of a skill again (retired or not): `version`, or the newest with none."""
    c = components(request)
    name = stored_skill(model_id)
    if name is None or not c.store.versions(name):
        raise _not_found(model_id)
    require(request, "admin", "rolling back a model")
    version = body.version if body is not None else None
    try:
        rec = c.store.activate(name, version)
    except KeyError:
        raise APIError(404, f"'{model_id}' has no version {version}", "version", "version_not_found") from None
    except UnreadableVersion as e:  # a damaged record: the version stays stored, and never serves
        raise APIError(409, f"{e}: roll back to another version", "version", "version_unreadable") from None
    c.pool.register(rec)
    await asyncio.to_thread(c.bus.publish, SkillActivated(name, rec.version))
    return {**_skill_object(c, rec), **_versions(c, name)}
