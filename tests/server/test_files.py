"""Uploaded training files: durable records in the data dir, safe ids, newest first."""

from __future__ import annotations

from pathlib import Path

from skillpool.server.files import FileStore


def test_files_round_trip_and_survive_a_new_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    a = store.create("../../etc/a.jsonl", "fine-tune", b'{"instruction": "x", "output": "y"}\n')
    b = store.create("b.jsonl", "fine-tune", b"{}\n")
    again = FileStore(tmp_path)  # another server on the shared data dir
    assert again.get(a.id) == a and a.filename == "a.jsonl" and a.bytes == 36
    assert again.content(a.id) == b'{"instruction": "x", "output": "y"}\n'
    assert {f.id for f in again.list()} == {a.id, b.id} and again.list("batch") == []
    assert again.delete(a.id) and not again.delete(a.id)
    assert store.get(a.id) is None and store.content(a.id) is None and [f.id for f in store.list()] == [b.id]


def test_ids_are_never_paths(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    assert store.get("../secret") is None and store.content("../secret") is None and not store.delete("../secret")
