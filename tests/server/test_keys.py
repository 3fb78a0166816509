"""The keys file and the key ring (server.auth): parsing, errors that name the line, who a header names,
reloads that keep the old keys when the new file is bad, and the start-up summary."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from skillpool.cli.main import main
from skillpool.server.auth import (
    ANONYMOUS,
    SINGLE_TENANT,
    KeyFileError,
    KeyFileWatch,
    KeyRing,
    Principal,
    parse_keys,
    required_role,
)
from skillpool.server.files import FileStore
from skillpool.trainer.service import Job
from tests.conftest import until


def test_a_keys_file_with_comments_and_blank_lines() -> None:
    keys = parse_keys("# who may call\n\nalice chat k1\n  bob train k2  # trains\nroot admin k3\n")
    assert [(k.name, k.role, k.secret) for k in keys] == [
        ("alice", "chat", b"k1"),
        ("bob", "train", b"k2"),
        ("root", "admin", b"k3"),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("alice chat k1\nbob train\n", "line 2: expected NAME ROLE KEY, found 2 field(s)"),
        ("alice chat k1 k2\n", "line 1: expected NAME ROLE KEY, found 4"),
        ("# header\nalice owner k1\n", "line 2: role 'owner' is not one of chat, train, admin"),
        ("a/b chat k1\n", "line 1: name 'a/b'"),
        ("alice chat k1\nalice train k2\n", "the name 'alice' is used by more than one key"),
        ("alice chat k1\nbob train k1\n", "the same key is listed twice"),
    ],
)
def test_a_malformed_keys_file_names_the_line(text: str, error: str) -> None:
    with pytest.raises(KeyFileError, match="keys file") as e:
        parse_keys(text)
    assert error in str(e.value) and "k1" not in str(e.value)  # never echoes a key


def test_the_flags_are_a_chat_key_and_an_admin_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("bob train kb\n")
    ring = KeyRing("ku", "ka", path)
    assert ring.principal(b"Bearer ku") == Principal("api-key", "chat")
    assert ring.principal(b"Bearer ka") == Principal("admin", "admin")
    assert ring.principal(b"bearer  kb ") == Principal("bob", "train")
    assert ring.principal(b"Bearer nope") is None and ring.principal(b"Basic a2I6") is None
    assert ring.principal(b"") == ANONYMOUS and ring.principal(b"Bearer ") == ANONYMOUS
    path.write_text("admin train kb\n")  # the admin flag's key is named "admin"
    with pytest.raises(KeyFileError, match="'admin' is used by more than one key"):
        KeyRing("ku", "ka", path)


def test_no_keys_is_single_tenant() -> None:
    ring = KeyRing()
    assert ring.principal(b"Bearer anything") == SINGLE_TENANT and SINGLE_TENANT.can("admin")
    assert "single-tenant" in ring.summary()


def test_the_summary_says_what_is_open() -> None:
    assert KeyRing(admin_key="ka").summary() == (
        "auth: keys: 1 admin; chat and models open to anyone; uploads and training need the admin key; "
        "force, retire, rollback and fallback clusters need the admin key; /metrics needs a metrics or admin key"
    )
    scraped = KeyRing(admin_key="ka", metrics_key="km").summary()
    assert "1 admin, 1 metrics" in scraped and "chat and models open to anyone" in scraped  # a scraper opens nothing
    assert "/metrics is open to anyone" in KeyRing(admin_key="ka", open_metrics=True).summary()
    only_chat = KeyRing(api_key="ku").summary()
    assert "every /v1 and /tasks call needs a key" in only_chat and "no key may upload or train" in only_chat
    assert "are closed (no admin key)" in only_chat


def test_reload_takes_a_good_file_and_keeps_the_keys_on_a_bad_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("alice chat k1\n")
    ring = KeyRing(path=path)
    path.write_text("alice chat k1\nbob train k2\n")
    assert ring.reload() and ring.principal(b"Bearer k2") == Principal("bob", "train")
    path.write_text("alice chat k1\nbob train\n")
    with caplog.at_level(logging.ERROR, logger="skillpool.server.auth"):
        assert not ring.reload()
    assert "line 2" in caplog.text and "the 2 key(s) in use stay" in caplog.text
    assert ring.principal(b"Bearer k2") == Principal("bob", "train")  # the old keys still serve
    path.unlink()
    assert not ring.reload() and ring.principal(b"Bearer k1") == Principal("alice", "chat")
    for empty in ("", "\n", "# all keys revoked\n"):  # read mid-write, or emptied: never open to everyone
        path.write_text(empty)
        assert not ring.reload() and ring.principal(b"Bearer k1") == Principal("alice", "chat")
        assert ring.principal(b"") != SINGLE_TENANT and "lists no keys" in caplog.text


def test_serve_refuses_a_keys_file_without_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# nobody yet\n")
    with pytest.raises(SystemExit, match=r"lists no keys"):
        main(["serve", "--data-dir", str(tmp_path / "data"), "--api-keys-file", str(path)])


def test_a_watch_follows_the_file_and_keeps_the_keys_while_it_is_gone_or_bad(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("alice chat k1\n")
    ring = KeyRing(path=path)
    watch = KeyFileWatch(ring, interval_s=0.05)
    looks: list[object] = []  # each time the watch looked at the file
    stamp = ring.stamp

    def looked() -> tuple[int, int] | None:
        looks.append(None)
        return stamp()

    ring.stamp = looked  # type: ignore[method-assign]

    def looked_again() -> None:
        """Wait until the watch began two more looks: the first saw the file as it is now, and has ended."""
        seen = len(looks)
        until(lambda: len(looks) >= seen + 2, timeout=10)

    try:
        path.write_text("alice chat k1\nbob train k2\n")  # a change of size and mtime: no signal needed
        until(lambda: ring.principal(b"Bearer k2") == Principal("bob", "train"), timeout=10)
        path.unlink()  # gone (a file being replaced): the keys in use stay
        looked_again()
        assert ring.principal(b"Bearer k2") == Principal("bob", "train")
        path.write_text("carol admin k3\n")
        until(lambda: ring.principal(b"Bearer k3") == Principal("carol", "admin"), timeout=10)
        assert ring.principal(b"Bearer k2") is None
        with caplog.at_level(logging.ERROR, logger="skillpool.server.auth"):
            path.write_text("carol admin\n")  # malformed: not taken
            until(lambda: "keys not reloaded" in caplog.text, timeout=10)
        assert ring.principal(b"Bearer k3") == Principal("carol", "admin")
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_roles_by_method_and_path() -> None:
    assert required_role("POST", "/v1/chat/completions") == "anonymous"
    assert required_role("GET", "/v1/models/x") == "anonymous"
    assert required_role("GET", "/v1/files/x/content") == "chat"
    assert required_role("POST", "/tasks") == "train"
    assert required_role("POST", "/v1/skills/import") == required_role("POST", "/v1/load_lora_adapter") == "train"
    assert required_role("POST", "/v1/unload_lora_adapter") == "admin"  # a retire
    assert required_role("POST", "/v1/models/x/rollback") == "admin"
    assert required_role("GET", "/v1/skillpool/fallback_clusters") == "admin"
    assert required_role("PUT", "/v1/something/new") == "admin"  # a new write is closed until given a role


def test_serve_stops_at_once_on_a_malformed_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# keys\nalice chat k1\nbob trainer k2\n")
    with pytest.raises(SystemExit, match=r"line 3: role 'trainer' is not one of chat, train, admin"):
        main(["serve", "--data-dir", str(tmp_path / "data"), "--api-keys-file", str(path)])


def test_records_from_before_keys_load_and_are_the_admins(tmp_path: Path) -> None:
    job = Job.from_dict({"id": "job-1", "skill": "s", "method": "isolated", "config": {}, "status": "failed"})
    files = FileStore(tmp_path)
    meta = files.dir / f"{files.create('a.jsonl', 'fine-tune', b'x', owner='bob').id}.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "owner"}))
    [old] = files.list()
    assert job.owner is None and old.owner is None
    assert Principal("root", "admin").sees(None) and not Principal("bob", "train").sees(None)
    assert SINGLE_TENANT.sees(None)
