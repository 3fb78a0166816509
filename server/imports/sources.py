"""Where an imported adapter's files come from: the uploaded archive, a folder on the server's side, or an s3://
prefix, the last two only inside what the operator allowed (`--allowed-adapter-paths`). A folder path is resolved
(links followed, `..` applied) before it is compared with the allowed folders, so no spelling of a path leads
outside them; an s3 URL must lie under an allowed s3 prefix, segment by segment.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.lora.adapter import AdapterRejected
from skillpool.lora.peft_archive import Entry, read_entries, read_folder

from ..errors import APIError


def _not_allowed(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param, "adapter_path_not_allowed")


def _allowed(setting: str | None) -> list[str]:
    return [p.strip() for p in (setting or "").split(",") if p.strip()]


def _s3_parts(url: str, param: str) -> tuple[str, tuple[str, ...]]:
    """(bucket, key segments) of s3://BUCKET/KEY..."""
    parts = urlsplit(url)
    segments = tuple(s for s in PurePosixPath(parts.path).parts if s != "/")
    if not parts.netloc or ".." in segments or parts.query or parts.fragment:
        raise _not_allowed(param, f"{url!r} is not an s3://BUCKET/PREFIX URL")
    return parts.netloc, segments


def read_path(raw: str, setting: str | None, max_bytes: int, param: str) -> tuple[dict[str, bytes], str]:
    """(the PEFT files at server path or s3 URL `raw`, the kind of source: "folder" or "s3"). A 400 naming `param`
    when the server allows no paths or `raw` lies outside every allowed one; AdapterRejected for what is found."""
    allowed = _allowed(setting)
    if not allowed:
        raise _not_allowed(
            param, "this server reads no adapters from its own paths (start it with --allowed-adapter-paths)"
        )
    if raw.startswith("s3://"):
        return _read_s3(raw, [a for a in allowed if a.startswith("s3://")], max_bytes, param), "s3"
    path = Path(raw)
    if not path.is_absolute():
        raise _not_allowed(param, f"{raw!r} is not an absolute path (or an s3://BUCKET/PREFIX URL)")
    real = path.resolve()
    roots = [Path(a).resolve() for a in allowed if not a.startswith("s3://")]
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise _not_allowed(param, f"{raw!r} is outside the folders this server may read adapters from")
    return read_folder(real, max_bytes), "folder"


def _read_s3(url: str, allowed: list[str], max_bytes: int, param: str) -> dict[str, bytes]:
    bucket, segments = _s3_parts(url, param)
    inside = False
    for root in allowed:
        root_bucket, root_segments = _s3_parts(root, "--allowed-adapter-paths")
        inside |= root_bucket == bucket and segments[: len(root_segments)] == root_segments
    if not inside:
        raise _not_allowed(param, f"{url!r} is outside the s3 prefixes this server may read adapters from")
    try:
        from skillpool.adapters_store.s3 import S3Objects
    except ImportError as e:
        raise APIError(
            400, f"{param}: reading s3:// needs boto3 (the cluster extra): {e}", param, "invalid_value"
        ) from None
    objects = S3Objects(bucket, "/".join(segments) + "/" if segments else "")
    try:
        sizes = objects.sizes("")

        def read(key: str) -> bytes:
            data = objects.get(key)
            if data is None:
                raise AdapterRejected("adapter_missing_file", f"{url}/{key} was removed while it was read")
            return data

        entries = [
            Entry(key, "folder" if "/" in key else "file", size, lambda key=key: read(key))
            for key, size in sizes.items()
        ]
        return read_entries(entries, max_bytes, f"the adapter prefix {url}")
    except StoreUnavailable as e:
        raise APIError(400, f"{param}: {url} cannot be read: {e}", param, "adapter_unreadable") from None
