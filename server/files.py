"""Uploaded training files (OpenAI's Files API, purpose `fine-tune`), kept in the data dir.

Layout: <data>/files/<file-id>.jsonl (the bytes as uploaded) and <file-id>.json (the record). The data
dir is the store that servers and trainer workers share in a Redis setup, so a file uploaded to one
server can be trained on by a job another server created. Writes are temp file + rename: a reader sees
a whole file or none. A write that fails (disk full) raises StorageError and leaves nothing behind, and temp
files of dead processes are swept when the store opens. The content is validated when a job uses it, not on
upload (as OpenAI does).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from skillpool.adapters_store.diskio import atomic_write, sweep

_ID = re.compile(r"^file-[0-9a-f]{24}$")
PURPOSES = frozenset({"fine-tune"})


@dataclass(frozen=True)
class StoredFile:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str | None = None  # the name of the API key that uploaded it; None: no keys (or an older record)


class FileStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = Path(root) / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        sweep(self.dir)  # partial uploads of processes that are gone

    def _paths(self, file_id: str) -> tuple[Path, Path] | None:
        if not _ID.match(file_id):  # ids become file names: never a path from the request
            return None
        return self.dir / f"{file_id}.json", self.dir / f"{file_id}.jsonl"

    def create(self, filename: str, purpose: str, data: bytes, owner: str | None = None) -> StoredFile:
        rec = StoredFile(
            id="file-" + uuid.uuid4().hex[:24],
            bytes=len(data),
            created_at=int(time.time()),
            filename=os.path.basename(filename) or "upload.jsonl",
            purpose=purpose,
            owner=owner,
        )
        meta, content = self._paths(rec.id) or (None, None)
        assert meta is not None and content is not None
        atomic_write(content, data)
        try:
            atomic_write(meta, json.dumps(asdict(rec)).encode())  # the record last: a listed file has its bytes
        except BaseException:
            content.unlink(missing_ok=True)
            raise
        return rec

    def get(self, file_id: str) -> StoredFile | None:
        paths = self._paths(file_id)
        if paths is None or not paths[0].is_file():
            return None
        return StoredFile(**json.loads(paths[0].read_text()))

    def content(self, file_id: str) -> bytes | None:
        paths = self._paths(file_id)
        if paths is None or not paths[1].is_file() or not paths[0].is_file():
            return None
        return paths[1].read_bytes()

    def list(self, purpose: str | None = None) -> list[StoredFile]:
        """Newest first."""
        out = []
        for p in self.dir.glob("file-*.json"):
            try:
                rec = StoredFile(**json.loads(p.read_text()))
            except (ValueError, TypeError, OSError):  # being replaced or deleted by another process
                continue
            if purpose is None or rec.purpose == purpose:
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_at, r.id), reverse=True)

    def delete(self, file_id: str) -> bool:
        paths = self._paths(file_id)
        if paths is None or not paths[0].is_file():
            return False
        paths[0].unlink(missing_ok=True)
        paths[1].unlink(missing_ok=True)
        return True
