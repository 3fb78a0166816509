"""The skill store on an S3 endpoint (moto's server on 127.0.0.1, a process of its own): versions published by a
marker written last, read through a size-bounded node disk cache with one download per object, and clear errors
when the store is unreachable or refuses the credentials."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from skillpool.adapters_store.diskio import owner_tag
from skillpool.adapters_store.s3 import S3Objects
from skillpool.adapters_store.store import SkillStore, StoreUnavailable, open_store
from skillpool.evaluation.process import free_port
from tests.adapters_store.test_diskio import _dead_tag
from tests.adapters_store.test_store import draft
from tests.s3 import KEYS, MotoServer, aws_env, make_bucket


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def bucket(moto: MotoServer) -> Iterator[str]:
    """A fresh bucket's URL, with the AWS settings that reach it in force."""
    name = f"skills-{uuid.uuid4().hex[:12]}"
    with aws_env(moto.env()):
        make_bucket(name)
        yield f"s3://{name}/pool"


def count_gets(store: SkillStore) -> Counter[str]:
    """GetObject requests the store's client sends, by key (the client's own event hook: the requests are real)."""
    gets: Counter[str] = Counter()
    client = store.objects.client  # type: ignore[attr-defined]
    client.meta.events.register("before-parameter-build.s3.GetObject", lambda params, **_: gets.update([params["Key"]]))
    return gets


def adapter_keys(store: SkillStore, name: str, version: int = 1) -> list[str]:
    prefix = store.objects.prefix  # type: ignore[attr-defined]
    return [f"{prefix}skills/{name}/v{version}/{f}" for f in ("adapter_config.json", "adapter_model.safetensors")]


def test_a_version_published_by_one_store_is_read_whole_by_another(bucket: str, tmp_path: Path) -> None:
    writer = open_store(tmp_path / "a", bucket)
    assert writer.write(draft()).version == 1 and writer.write(draft()).version == 2
    writer.write(draft("sst-2"))
    reader = open_store(tmp_path / "b", bucket)  # another node: an empty cache
    assert [(r.name, r.version) for r in reader.list_latest()] == [("agnews", 2), ("sst-2", 1)]
    rec = reader.get("agnews", 1)
    assert rec is not None and rec.meta["eval"]["score"] == 0.9
    f = rec.adapter().modules["model.layers.0.self_attn.q_proj"]
    assert f.rank == 2 and f.scaling == 2.0 and torch.equal(f.A, torch.ones(2, 8))
    assert torch.equal(rec.router_tensors()["centroid_keys"], torch.eye(3))
    assert rec.replay()[0]["answer"] == "x" and rec.pseudo() == []
    assert [r.version for r in reader.versions("agnews")] == [1, 2]
    assert not any(k.endswith(".claim") for k in reader.objects.list("skills/"))  # published versions hold no claim

    reader.retire("agnews")  # the lifecycle is the shared store's: every node agrees
    assert [r.name for r in writer.list_latest()] == ["sst-2"] and writer.serving("agnews") is None
    assert writer.activate("agnews", 1).version == 1
    assert reader.serving("agnews").version == 1 and reader.state("agnews") == {"retired": False, "pinned": 1}  # type: ignore[union-attr]
    assert reader.write(draft()).version == 3 and writer.serving("agnews").version == 3  # type: ignore[union-attr]


class FailingUpload(S3Objects):
    """The real store, whose `fail_at`-th upload raises (a connection lost midway); it notes, before each upload,
    whether an observer on the same bucket already sees the version."""

    def __init__(self, url: str, fail_at: int | None, observer: SkillStore | None = None) -> None:
        other = S3Objects.from_url(url)
        super().__init__(other.bucket, other.prefix, other.client)
        self.fail_at, self.observer = fail_at, observer
        self.sent: list[tuple[str, bool]] = []

    def upload(self, key: str, path: Path) -> None:
        seen = self.observer is not None and self.observer.get("agnews") is not None
        self.sent.append((key, seen))
        if len(self.sent) == self.fail_at:
            raise StoreUnavailable("the connection was lost")
        super().upload(key, path)


def test_the_marker_is_written_last_and_a_failed_publish_leaves_no_version(bucket: str, tmp_path: Path) -> None:
    observer = open_store(tmp_path / "observer", bucket)
    store = SkillStore(tmp_path / "a", FailingUpload(bucket, fail_at=None, observer=observer))
    store.write(draft())
    sent = store.objects.sent  # type: ignore[attr-defined]
    assert sent[-1][0].endswith("/meta.json") and len(sent) == 7
    assert not any(seen for _, seen in sent)  # invisible until the marker landed
    assert observer.get("agnews") is not None

    failing = SkillStore(tmp_path / "b", FailingUpload(bucket, fail_at=3))
    with pytest.raises(StoreUnavailable):
        failing.write(draft())
    assert [r.version for r in observer.versions("agnews")] == [1]
    assert not any("/v2/" in k for k in observer.objects.list("skills/"))  # its uploads were taken back
    assert list((tmp_path / "b" / "tmp").iterdir()) == []
    assert observer.write(draft()).version == 2


def test_a_killed_writer_s_objects_stay_invisible_until_a_start_sweeps_them(bucket: str, tmp_path: Path) -> None:
    store = open_store(tmp_path / "a", bucket)
    objects = store.objects
    claim = {"owner": _dead_tag(), "time": time.time()}
    objects.put("skills/agnews/v1/.claim", json.dumps(claim).encode())  # killed after two uploads
    objects.put("skills/agnews/v1/adapter_config.json", b"{}")
    objects.put("skills/agnews/v1/router.safetensors", b"?")
    live = {"owner": owner_tag(), "time": time.time()}
    objects.put("skills/sst-2/v1/.claim", json.dumps(live).encode())  # a live writer, mid-upload
    objects.put("skills/sst-2/v1/replay.json", b"[]")
    assert store.list_latest() == [] and store.get("agnews") is None and store.versions("agnews") == []
    assert store.write(draft()).version == 2  # never over another writer's unfinished version

    store.clean_tmp()
    keys = objects.list("skills/")
    assert not any(k.startswith("skills/agnews/v1/") for k in keys)
    assert {"skills/sst-2/v1/.claim", "skills/sst-2/v1/replay.json"} <= set(keys)
    assert [(r.name, r.version) for r in store.list_latest()] == [("agnews", 2)]


def test_the_disk_cache_keeps_the_most_recent_versions_within_its_bound(bucket: str, tmp_path: Path) -> None:
    writer = open_store(tmp_path / "a", bucket)
    for name in ("one", "two", "three"):
        writer.write(draft(name))
    size = sum(
        len(writer.objects.get(f"skills/one/v1/{f}") or b"")
        for f in ("adapter_config.json", "adapter_model.safetensors")
    )
    reader = open_store(tmp_path / "b", bucket, cache_bytes=2 * size)  # two adapters' files fit
    gets = count_gets(reader)
    records = {name: reader.get(name) for name in ("one", "two", "three")}
    for name in ("one", "two", "three"):
        records[name].adapter()  # type: ignore[union-attr]
    cache = reader.cache
    assert cache is not None and cache.bytes <= 2 * size
    on_disk = sum(p.stat().st_size for p in cache.root.rglob("*") if p.is_file())
    assert on_disk == cache.bytes
    assert not (records["one"].path / "adapter_model.safetensors").exists()  # type: ignore[union-attr]
    assert (records["three"].path / "adapter_model.safetensors").exists()  # type: ignore[union-attr]

    records["two"].adapter()  # type: ignore[union-attr]  # a disk hit: no request
    assert all(gets[k] == 1 for k in adapter_keys(reader, "two"))
    records["one"].adapter()  # type: ignore[union-attr]  # evicted: fetched again, and "three" is now oldest
    assert all(gets[k] == 2 for k in adapter_keys(reader, "one"))
    assert not (records["three"].path / "adapter_model.safetensors").exists()  # type: ignore[union-attr]
    hits, loads = reader.tiers.snapshot()
    assert hits == {"store": 4, "disk": 1} and loads == {"disk": 4}

    nothing = open_store(tmp_path / "c", bucket, cache_bytes=0)  # no cache at all: every read downloads
    rec = nothing.get("one")
    assert rec is not None and rec.adapter().modules and nothing.cache is not None and nothing.cache.bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        open_store(tmp_path / "d", bucket, cache_bytes=-1)


def test_fifty_concurrent_cold_readers_download_each_object_once(bucket: str, tmp_path: Path) -> None:
    open_store(tmp_path / "a", bucket).write(draft())
    reader = open_store(tmp_path / "b", bucket)
    rec = reader.get("agnews")
    assert rec is not None
    gets = count_gets(reader)
    start = threading.Barrier(50)
    results: list[Any] = [None] * 50

    def read(i: int) -> None:
        start.wait()
        results[i] = rec.adapter()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: gets[k] for k in adapter_keys(reader, "agnews")} == {k: 1 for k in adapter_keys(reader, "agnews")}
    assert sum(gets.values()) == 2
    assert all(
        r is not None and torch.equal(r.modules["model.layers.0.self_attn.q_proj"].A, torch.ones(2, 8)) for r in results
    )
    hits, loads = reader.tiers.snapshot()
    assert hits == {"store": 1, "disk": 49} and loads == {"disk": 1}

    neighbour = open_store(tmp_path / "b", bucket)  # a second process on the node: the same cache folder
    again = neighbour.get("agnews")
    gets = count_gets(neighbour)
    assert again is not None and again.adapter().modules and sum(gets.values()) == 0
    assert not [p for p in (tmp_path / "b" / "cache").rglob("*.tmp")]  # renamed into place, whole


def test_a_stopped_store_fails_cold_reads_clearly_and_cached_ones_go_on(tmp_path: Path) -> None:
    server = MotoServer()
    try:
        with aws_env(server.env()):
            make_bucket("skills-stopped")
            url = "s3://skills-stopped"
            writer = open_store(tmp_path / "a", url)
            writer.write(draft("warm"))
            writer.write(draft("cold"))
            reader = open_store(tmp_path / "b", url)
            warm, cold = reader.get("warm"), reader.get("cold")
            assert warm is not None and cold is not None
            warm.adapter()
            server.stop()
            assert warm.adapter().modules  # from the disk cache
            with pytest.raises(StoreUnavailable, match="unreachable") as e:
                cold.adapter()
            assert url in str(e.value)
            with pytest.raises(StoreUnavailable, match="unreachable"):
                cold.fetch_adapter()
            with pytest.raises(StoreUnavailable):  # and a publish stores nothing
                writer.write(draft("late"))
            assert list((tmp_path / "a" / "tmp").iterdir()) == []
    finally:
        server.stop()


def test_an_unreachable_store_is_a_clear_error_at_start(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with aws_env({**KEYS, "AWS_ENDPOINT_URL": nowhere}):
        with pytest.raises(StoreUnavailable, match=r"s3://skills/ is unreachable at http://127\.0\.0\.1:\d+"):
            open_store(tmp_path, "s3://skills")


def test_refused_credentials_are_a_clear_error(tmp_path: Path) -> None:
    server = MotoServer(auth=True)  # checks every request's key, and knows none
    try:
        with aws_env(server.env()):
            with pytest.raises(StoreUnavailable, match="refused the credentials") as e:
                open_store(tmp_path, "s3://skills/pool")
            assert "AWS_ACCESS_KEY_ID" in str(e.value)
    finally:
        server.stop()


def test_a_missing_bucket_and_a_bad_url_are_named(moto: MotoServer, tmp_path: Path) -> None:
    with aws_env(moto.env()):
        with pytest.raises(StoreUnavailable, match="bucket 'no-such-bucket' does not exist"):
            open_store(tmp_path, "s3://no-such-bucket/x")
    with pytest.raises(ValueError, match="s3://BUCKET/PREFIX"):
        open_store(tmp_path, "ftp://host/x")
    folder = open_store(tmp_path / "data", f"file://{tmp_path / 'shared'}")  # a folder: today's layout there
    assert folder.write(draft()).path == tmp_path / "shared" / "skills" / "agnews" / "v1" and not folder.remote


def test_two_writers_at_once_never_take_one_version(bucket: str, tmp_path: Path) -> None:
    """Two nodes storing the same skill at the same moment: the claim (a conditional write) gives each its own."""
    stores = [open_store(tmp_path / f"node{i}", bucket) for i in range(2)]
    start = threading.Barrier(2)
    versions: list[int] = []

    def write(store: SkillStore) -> None:
        start.wait()
        versions.extend(store.write(draft()).version for _ in range(3))

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == [1, 2, 3, 4, 5, 6]
    assert [r.version for r in stores[0].versions("agnews")] == [1, 2, 3, 4, 5, 6]
