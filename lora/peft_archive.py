"""A PEFT LoRA folder in transit: read from a tar (gzipped or not) or from a folder, and packed as a tar.gz to export.

Only the two PEFT files travel: adapter_config.json and adapter_model.safetensors, at the archive's root or in one
folder. The model card PEFT's `save_pretrained` writes beside them (README.md) is tolerated and dropped. Anything
else is refused, naming the entry: a pickle (adapter_model.bin), any other file, a link, a device, a nested folder,
a path that leaves the archive's folder. Nothing is extracted to disk: the two files are read into memory, and the
sizes the archive declares are bounded before a byte of them is read (a gzip bomb decompresses no further).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath

from .adapter import PEFT_CONFIG, PEFT_WEIGHTS, AdapterRejected

ADAPTER_FILES = (PEFT_CONFIG, PEFT_WEIGHTS)
MODEL_CARD = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_ENTRIES = 16  # the two files, a model card, their folder: an archive of thousands of entries is not an adapter


def _file_name(name: str, where: str) -> str | None:
    """The PEFT file an entry `name` is, None for the tolerated model card; AdapterRejected for any other."""
    if name in ADAPTER_FILES:
        return name
    if name == MODEL_CARD:
        return None
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterRejected(
            "adapter_pickle",
            f"{where}{name} is a pickle: only safetensors weights are read (save the adapter with PEFT's "
            "save_pretrained(..., safe_serialization=True))",
        )
    raise AdapterRejected(
        "adapter_extra_file", f"{where}{name}: an adapter holds only {PEFT_CONFIG} and {PEFT_WEIGHTS}"
    )


def _complete(files: dict[str, bytes], where: str) -> dict[str, bytes]:
    missing = [f for f in ADAPTER_FILES if f not in files]
    if missing:
        raise AdapterRejected(
            "adapter_missing_file", f"{where}has no {missing[0]} (a PEFT LoRA folder holds both files)"
        )
    return files


def _too_large(total: int, max_bytes: int) -> AdapterRejected:
    return AdapterRejected("adapter_too_large", f"the adapter's files hold {total} bytes, more than {max_bytes}")


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The entry's path parts, `.` dropped; AdapterRejected when it leaves the archive's folder."""
    name = member.name
    parts = PurePosixPath(name).parts
    if name.startswith("/") or "\\" in name or ".." in parts:
        raise AdapterRejected("adapter_unsafe_path", f"archive entry {name!r} leaves the archive's folder")
    return tuple(p for p in parts if p != ".")


def read_tar(data: bytes, max_bytes: int) -> dict[str, bytes]:
    """The PEFT files of a tar or tar.gz archive, by file name; AdapterRejected naming the first bad entry."""
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise AdapterRejected("invalid_archive", f"the adapter is not a tar or tar.gz archive ({e})") from None
    files: dict[str, bytes] = {}
    folder: str | None = None  # the one folder the files are in ("" at the root)
    total = entries = 0
    with archive:
        try:
            for member in archive:
                entries += 1
                if entries > MAX_ENTRIES:
                    raise AdapterRejected(
                        "adapter_extra_file", f"the archive holds more than {MAX_ENTRIES} entries: not one PEFT folder"
                    )
                parts = _member_parts(member)
                if not parts:
                    continue  # the archive's own "." entry
                if member.isdir():
                    if len(parts) > 1:
                        raise AdapterRejected(
                            "adapter_extra_file",
                            f"archive entry {member.name!r} is a folder inside the adapter's folder",
                        )
                    folder = _same_folder(folder, parts[0], member.name)
                    continue
                if not member.isfile():
                    kind = "link" if member.issym() or member.islnk() else "special file"
                    raise AdapterRejected(
                        "adapter_extra_file", f"archive entry {member.name!r} is a {kind}: only plain files are read"
                    )
                if len(parts) > 2:
                    raise AdapterRejected(
                        "adapter_extra_file",
                        f"archive entry {member.name!r} is in a folder inside the adapter's folder",
                    )
                folder = _same_folder(folder, parts[0] if len(parts) == 2 else "", member.name)
                total += member.size
                if total > max_bytes:
                    raise _too_large(total, max_bytes)
                name = _file_name(parts[-1], "archive entry ")
                if name is None:
                    continue
                if name in files:
                    raise AdapterRejected("adapter_extra_file", f"the archive holds {name} twice")
                fh = archive.extractfile(member)
                assert fh is not None  # a regular file always has its data
                files[name] = fh.read(member.size)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise AdapterRejected("invalid_archive", f"the adapter archive is damaged ({e})") from None
    return _complete(files, "the archive ")


def _same_folder(seen: str | None, folder: str, entry: str) -> str:
    if seen is not None and seen != folder:
        raise AdapterRejected(
            "adapter_extra_file", f"archive entry {entry!r} is outside the adapter's folder {seen or '(the root)'!r}"
        )
    return folder


@dataclass(frozen=True)
class Entry:
    """One entry of a folder an adapter is read from (on disk, or under an object store's prefix)."""

    name: str
    kind: str  # "file", or what else it is: "folder", "link", "special file"
    size: int
    read: Callable[[], bytes]


def read_entries(entries: Iterable[Entry], max_bytes: int, where: str = "the adapter folder") -> dict[str, bytes]:
    """The PEFT files among a folder's entries, by file name; AdapterRejected naming the first entry that is not one
    of them (nothing is read before every entry is known to be allowed and the sizes fit)."""
    chosen: list[tuple[str, Entry]] = []
    total = 0
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.kind != "file":
            raise AdapterRejected(
                "adapter_extra_file", f"{where}'s entry {entry.name!r} is a {entry.kind}: only plain files are read"
            )
        name = _file_name(entry.name, f"{where}'s ")
        total += entry.size
        if total > max_bytes:
            raise _too_large(total, max_bytes)
        if name is not None:
            chosen.append((name, entry))
    files = {}
    for name, entry in chosen:
        data = entry.read()
        if len(data) > entry.size:  # grew since it was listed
            raise _too_large(total - entry.size + len(data), max_bytes)
        files[name] = data
    return _complete(files, f"{where} ")


def read_folder(folder: Path, max_bytes: int) -> dict[str, bytes]:
    """The PEFT files of a folder on disk (links are refused, not followed)."""
    try:
        scanned = list(os.scandir(folder))
    except NotADirectoryError:
        raise AdapterRejected("adapter_missing_file", "the adapter path is not a folder") from None
    except FileNotFoundError:
        raise AdapterRejected("adapter_missing_file", "the adapter path does not exist") from None
    entries = []
    for e in scanned:
        st = e.stat(follow_symlinks=False)
        kind = (
            "file"
            if stat.S_ISREG(st.st_mode)
            else "link"
            if stat.S_ISLNK(st.st_mode)
            else "folder"
            if stat.S_ISDIR(st.st_mode)
            else "special file"
        )
        entries.append(Entry(e.name, kind, st.st_size, partial(_read_bounded, Path(e.path), st.st_size)))
    return read_entries(entries, max_bytes)


def _read_bounded(path: Path, size: int) -> bytes:
    with path.open("rb") as fh:
        return fh.read(size + 1)


def pack_tar(files: Mapping[str, bytes], folder: str) -> bytes:
    """`files` as a tar.gz holding the folder `folder` (what `tar xzf` unpacks and PEFT or vLLM then load)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        top = tarfile.TarInfo(folder)
        top.type, top.mode = tarfile.DIRTYPE, 0o755
        archive.addfile(top)
        for name, data in files.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()
