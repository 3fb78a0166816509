"""PEFT folders in transit: a tar (gzipped or not) or a folder gives its two files and nothing else; every entry that
is not one of them (a pickle, another file, a link, a nested folder, a path that leaves the archive) is refused by
name, and a gzip bomb is refused by the sizes it declares before it is decompressed."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from skillpool.lora.adapter import AdapterRejected
from skillpool.lora.peft_archive import Entry, pack_tar, read_entries, read_folder, read_tar

FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"weights"}


def tar_of(entries: list[tuple[str, bytes | str | None]], gz: bool = True) -> bytes:
    """A tar of (name, content): bytes a file, a str a symlink to it, None a folder."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz" if gz else "w") as t:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                t.addfile(info)
            else:
                info.size = len(content)
                t.addfile(info, io.BytesIO(content))
    return out.getvalue()


def refused(code: str, fn, *args) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(AdapterRejected) as e:
        fn(*args)
    assert e.value.code == code, str(e.value)
    return str(e.value)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("folder", ["", "my-adapter/", "./"])
def test_a_tar_of_a_peft_folder_gives_its_two_files(gz: bool, folder: str) -> None:
    entries: list[tuple[str, bytes | str | None]] = [(folder.rstrip("/"), None)] if folder.strip("./") else []
    entries += [(folder + n, d) for n, d in FILES.items()] + [(folder + "README.md", b"# model card")]
    assert read_tar(tar_of(entries, gz), 1000) == FILES


def test_pack_tar_reads_back_as_one_folder() -> None:
    data = pack_tar(FILES, "skill-v3")
    assert read_tar(data, 1000) == FILES
    assert tarfile.open(fileobj=io.BytesIO(data)).getnames() == ["skill-v3", *(f"skill-v3/{n}" for n in FILES)]


@pytest.mark.parametrize(
    ("entries", "code", "named"),
    [
        ([("adapter_model.bin", b"pickle")], "adapter_pickle", "adapter_model.bin"),
        ([("a/optimizer.pt", b"pickle")], "adapter_pickle", "optimizer.pt"),
        ([("notes.txt", b"hi")], "adapter_extra_file", "notes.txt"),
        ([("../adapter_config.json", b"{}")], "adapter_unsafe_path", "../adapter_config.json"),
        ([("a/../../x", b"{}")], "adapter_unsafe_path", "a/../../x"),
        ([("/etc/adapter_config.json", b"{}")], "adapter_unsafe_path", "/etc/adapter_config.json"),
        ([("adapter_config.json", "/etc/passwd")], "adapter_extra_file", "link"),
        ([("a/b/adapter_config.json", b"{}")], "adapter_extra_file", "a/b/adapter_config.json"),
        ([("a", None), ("b/adapter_config.json", b"{}")], "adapter_extra_file", "outside"),
        ([("adapter_config.json", b"{}"), ("./adapter_config.json", b"{}")], "adapter_extra_file", "twice"),
        ([], "adapter_missing_file", "adapter_config.json"),
    ],
)
def test_every_entry_besides_the_two_files_is_refused_by_name(entries, code: str, named: str) -> None:  # type: ignore[no-untyped-def]
    good = [(n, d) for n, d in FILES.items()]
    message = refused(code, read_tar, tar_of([*entries, *good] if entries else good[1:]), 1000)
    assert named in message


def test_not_an_archive_and_a_cut_one_are_refused() -> None:
    refused("invalid_archive", read_tar, b"not a tar at all", 1000)
    whole = tar_of(list(FILES.items()), gz=True)
    refused("invalid_archive", read_tar, whole[: len(whole) // 2], 1000)


def test_a_gzip_bomb_is_refused_by_its_declared_sizes() -> None:
    info = tarfile.TarInfo("README.md")
    info.size = 200 * 2**20
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as t:
        t.addfile(info, io.BytesIO(bytes(info.size)))
    bomb = gzip.compress(raw.getvalue())
    assert len(bomb) < 2**20  # a small upload that would be 200 MiB unpacked
    assert "more than" in refused("adapter_too_large", read_tar, bomb, 2**20)


def test_a_folder_gives_its_two_files_and_refuses_links_and_folders(tmp_path: Path) -> None:
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "README.md").write_text("# card")
    assert read_folder(tmp_path, 1000) == FILES
    refused("adapter_too_large", read_folder, tmp_path, 10)
    os.symlink("/etc/passwd", tmp_path / "extra")
    assert "link" in refused("adapter_extra_file", read_folder, tmp_path, 1000)
    (tmp_path / "extra").unlink()
    (tmp_path / "checkpoint-1").mkdir()
    assert "folder" in refused("adapter_extra_file", read_folder, tmp_path, 1000)
    refused("adapter_missing_file", read_folder, tmp_path / "nowhere", 1000)


def test_entries_are_all_checked_before_any_is_read() -> None:
    read: list[str] = []

    def entry(name: str, kind: str = "file") -> Entry:
        return Entry(name, kind, 4, lambda: read.append(name) or b"data")  # type: ignore[func-returns-value]

    refused("adapter_extra_file", read_entries, [entry(n) for n in FILES] + [entry("sub/x", "folder")], 1000)
    assert read == []
