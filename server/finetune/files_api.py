"""/v1/files: upload, list, retrieve, download and delete training files (OpenAI's Files API, `fine-tune`
purpose only). The bytes live in the shared data dir (server.files); jobs validate them line by line."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from ..auth import Principal, principal_of, require
from ..components import components
from ..errors import APIError
from ..files import PURPOSES, FileStore, StoredFile
from .protocol import FileDeleted, FileObject, page

if TYPE_CHECKING:
    pass

api = APIRouter()


def file_object(f: StoredFile) -> FileObject:
    return FileObject(id=f.id, bytes=f.bytes, created_at=f.created_at, filename=f.filename, purpose=f.purpose)


def get_file(files: FileStore, file_id: str, caller: Principal, param: str = "file_id") -> StoredFile:
    f = files.get(file_id)
    if f is None or not caller.sees(f.owner):  # another key's file: as if there were none
        raise APIError(404, f"No such File object: {file_id}", param, "file_not_found")
    return f


@api.post("/v1/files")
async def create_file(request: Request) -> dict[str, Any]:
    c = components(request)
    limit = c.cfg.http.max_upload_bytes
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            400, "POST /v1/files takes multipart/form-data with 'file' and 'purpose'", None, "invalid_request"
        )
    form = await request.form(max_part_size=limit + 1)
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(purpose, str) or purpose not in PURPOSES:
        raise APIError(400, f"purpose must be one of {sorted(PURPOSES)}, got {purpose!r}", "purpose", "invalid_value")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "missing multipart field 'file'", "file", "missing_required_parameter")
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, f"file is larger than {limit} bytes", "file", "file_too_large")
    owner = require(request, "train", "uploading a file").name
    stored = await asyncio.to_thread(c.files.create, upload.filename or "upload.jsonl", purpose, data, owner)
    return file_object(stored).model_dump()


@api.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = Query(10000, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    caller = principal_of(request)
    files = [file_object(f) for f in components(request).files.list(purpose) if caller.sees(f.owner)]
    return page(files[::-1] if order == "asc" else files, after, limit)


@api.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return file_object(get_file(components(request).files, file_id, principal_of(request))).model_dump()


@api.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    c = components(request)
    get_file(c.files, file_id, principal_of(request))
    data = c.files.content(file_id)
    if data is None:
        raise APIError(404, f"No such File object: {file_id}", "file_id", "file_not_found")
    return Response(data, media_type="application/octet-stream")


@api.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    c = components(request)
    get_file(c.files, file_id, require(request, "train", "deleting a file"))
    c.files.delete(file_id)
    return FileDeleted(id=file_id).model_dump()
