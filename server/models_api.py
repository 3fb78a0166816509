"""/v1/models and the skill lifecycle: list and retrieve (with a skill's versions and quality report),
DELETE retires a skill, POST …/rollback serves an earlier version again (admin), GET …/adapter exports the served
version's PEFT files.

Retire and rollback write the shared store's state first (adapters_store: nothing is deleted), act on this
server, then publish an event on the skill-event bus (trainer.bus) so that every other server follows without
a restart; a server that was down reads the same state when it starts.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, StrictInt

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.adapters_store.store import SkillRecord, UnreadableVersion
from skillpool.lora.peft_archive import ADAPTER_FILES, pack_tar
from skillpool.lora.peft_checks import MAX_RANK, check_peft_files
from skillpool.runtime.base_model import linear_shapes
from skillpool.trainer.events import SkillActivated, SkillRetired

from .auth import require
from .components import components
from .errors import APIError
from .intake import Fields, check_owner

if TYPE_CHECKING:
    from .components import Components

api = APIRouter(prefix="/v1/models")
EXPORT = Fields("method", "force", "model", "config")  # the export's errors name the model


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
    await retire(c, name)
    return {"id": model_id, "object": "model", "deleted": True}


async def retire(c: Components, name: str) -> None:
    """Retire served skill `name`: the store's state first, then this server, then every other one (the bus)."""
    c.store.retire(name)
    c.pool.unregister(name)
    await asyncio.to_thread(c.bus.publish, SkillRetired(name))


@api.get("/{model_id}/adapter")
async def export_adapter(request: Request, model_id: str) -> Response:
    """The served version of a skill as a tar.gz of its PEFT files (a folder `<skill>-v<version>/`), loadable by
    `peft.PeftModel.from_pretrained` and vLLM's `--lora-modules`. A train key exports the skills it created, the
    admin any: the weights are the work of the data their creator uploaded."""
    c = components(request)
    name = c.pool.resolve(model_id)
    rec = c.pool.get(name) if name is not None else None
    if name is None or rec is None:
        raise _not_found(model_id)
    caller = require(request, "train", "exporting a skill's adapter")
    await asyncio.to_thread(check_owner, c, caller, name, EXPORT, "exporting its adapter")
    data = await asyncio.to_thread(_export, c, rec)
    folder = f"{name}-v{rec.version}"
    headers = {
        "Content-Disposition": f'attachment; filename="{folder}.tar.gz"',
        "x-skillpool-version": str(rec.version),
    }
    return Response(data, media_type="application/gzip", headers=headers)


def _export(c: Components, rec: SkillRecord) -> bytes:
    """The version's PEFT files, checked and written as an import writes them (our base model's id in the config)."""
    checked = check_peft_files(rec.adapter_files(), linear_shapes(str(c.base.path)), MAX_RANK, c.base.model_id)
    with tempfile.TemporaryDirectory(prefix="export-", dir=c.store.tmp_dir) as tmp:
        checked.save(Path(tmp), c.base.model_id)
        files = {n: (Path(tmp) / n).read_bytes() for n in ADAPTER_FILES}
    return pack_tar(files, f"{rec.name}-v{rec.version}")


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
