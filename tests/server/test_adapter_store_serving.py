"""A server whose skills live in an S3 bucket (moto's server on 127.0.0.1): a skill another store published is
served from an empty disk cache, and when the store goes away only the requests that need it fail, with 503 in
OpenAI's envelope that names no store, endpoint or object; the base model and the skills the engine holds go on,
whatever the cold requests, even with no room for another skill (a cold skill is read before a resident one
leaves). `skillpool serve` with a store it cannot reach stops at once, saying so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.adapters_store.store import open_store
from skillpool.evaluation.process import free_port
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.s3 import KEYS, MotoServer, aws_env, make_bucket
from tests.server.test_metrics_series import scrape, store_skill, value


def chat(http: TestClient, model: str) -> object:
    return http.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )


def test_a_published_skill_is_served_and_a_store_outage_fails_only_cold_skills(
    tiny_base, embedder, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    moto = MotoServer()
    try:
        with aws_env(moto.env()):
            make_bucket("skills-serving")
            url = "s3://skills-serving/pool"
            writer = SimpleNamespace(base=tiny_base, store=open_store(tmp_path / "trainer", url))  # another node
            for name in ("warm", "cold"):
                store_skill(writer, embedder, name, "accuracy", 0.5)
            cfg = ServerConfig.of(data_dir=tmp_path / "server", adapter_store=url, replica_name="r1")
            c = build_components(cfg, base=tiny_base, embedder=embedder)
            try:
                with TestClient(create_app(c)) as http:
                    served = {m["id"] for m in http.get("/v1/models").json()["data"]}
                    assert {"warm", "cold"} <= served
                    assert c.store.cache is not None and not any("adapter" in k for k in c.store.cache.keys())
                    assert chat(http, "warm").status_code == 200  # type: ignore[attr-defined]
                    m = scrape(http)
                    replica = {"replica": "r1"}
                    assert value(m, "skillpool_adapter_hits_total", tier="store", **replica) == 1  # from the bucket
                    assert value(m, "skillpool_adapter_loads_total", tier="disk", **replica) == 1
                    assert value(m, "skillpool_adapter_loads_total", tier="gpu", **replica) == 1

                    moto.stop()
                    cold = chat(http, "cold")
                    assert cold.status_code == 503, cold.text  # type: ignore[attr-defined]
                    error = cold.json()["error"]  # type: ignore[attr-defined]
                    assert error["code"] == "adapter_store_unavailable" and error["param"] == "model"
                    assert error["type"] == "service_unavailable_error"
                    assert cold.headers["retry-after"] == "5"  # type: ignore[attr-defined]
                    # what else needs the store: the same 503, and none tells the caller where the store is
                    for method, path, kw in [
                        ("GET", "/v1/models/cold", {}),
                        ("POST", "/v1/models/cold/rollback", {"json": {}}),
                        ("POST", "/tasks", {"data": {"name": "cold"}, "files": {"file": ("a.jsonl", b"{}")}}),
                        (
                            "POST",
                            "/v1/chat/completions",
                            {"json": {"model": "cold", "messages": [{"role": "user", "content": "x"}]}},
                        ),
                    ]:
                        r = http.request(method, path, **kw)
                        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_store_unavailable", r.text
                        assert r.headers["retry-after"] == "5"
                        for secret in (url, "skills-serving", moto.url, str(moto.port), "skills/", "meta.json"):
                            assert secret not in r.text, (path, secret, r.text)
                    assert chat(http, "base").status_code == 200  # type: ignore[attr-defined]
                    assert chat(http, "warm").status_code == 200  # type: ignore[attr-defined]  # the engine holds it
                    assert http.get("/healthz").status_code == 200
                    m = scrape(http)
                    assert value(m, "skillpool_adapter_hits_total", tier="gpu", **replica) == 1
            finally:
                c.close()
    finally:
        moto.stop()


@pytest.mark.parametrize("max_loaded", [1, 2])
def test_a_store_outage_never_takes_a_resident_skill_down(tiny_base, embedder, tmp_path: Path, max_loaded: int) -> None:  # type: ignore[no-untyped-def]
    warm, cold = [f"warm{i}" for i in range(max_loaded)], ["cold0", "cold1"]
    moto = MotoServer()
    try:
        with aws_env(moto.env()):
            make_bucket("skills-outage")
            url = "s3://skills-outage/pool"
            writer = SimpleNamespace(base=tiny_base, store=open_store(tmp_path / "trainer", url))
            for name in warm + cold:
                store_skill(writer, embedder, name, "accuracy", 0.5)
            # no disk cache: a skill the engine let go could only come back from the store
            cfg = ServerConfig.of(
                data_dir=tmp_path / "server", adapter_store=url, adapter_cache_bytes=0, max_loaded_skills=max_loaded
            )
            c = build_components(cfg, base=tiny_base, embedder=embedder)
            try:
                with TestClient(create_app(c)) as http:
                    for name in warm:
                        assert chat(http, name).status_code == 200  # type: ignore[attr-defined]
                    moto.stop()
                    mixes = [f"{warm[0]}=0.5,{cold[0]}=0.5"] if max_loaded > 1 else []  # a mix must fit the engine
                    requests = st.sampled_from([*cold, *warm, "base", *mixes])

                    @given(sequence=st.lists(requests, min_size=1, max_size=8))
                    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
                    def outage(sequence: list[str]) -> None:
                        for model in sequence:
                            r = chat(http, model)
                            needs_cold = any(name in model for name in cold)
                            want = 503 if needs_cold else 200
                            assert r.status_code == want, (sequence, model, r.text)  # type: ignore[attr-defined]
                            health = http.get("/healthz").json()
                            assert health["resident_skills"] == max_loaded, (sequence, model, health)

                    outage()
            finally:
                c.close()
    finally:
        moto.stop()


@pytest.mark.slow
def test_serve_with_an_unreachable_store_stops_at_once_saying_so(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with aws_env({**KEYS, "AWS_ENDPOINT_URL": nowhere}):
        done = subprocess.run(
            [str(Path(sys.executable).with_name("skillpool")), "serve", "--data-dir", str(tmp_path)]
            + ["--adapter-store", "s3://skills/pool", "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert (
        f"skillpool serve: cannot start: the adapter store s3://skills/pool/ is unreachable at {nowhere}" in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_the_store_flags_of_serve_and_worker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from skillpool.server.cli import add_arguments
    from skillpool.trainer.jobs.worker import add_arguments as worker_arguments

    for name in ("SKILLPOOL_ADAPTER_STORE", "SKILLPOOL_REPLICA", "SKILLPOOL_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    serve, worker = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_arguments(serve)
    worker_arguments(worker)
    cfg = ServerConfig.from_cli_args(
        serve.parse_args(["--adapter-store", "s3://b/p", "--adapter-cache-bytes", "512MiB", "--replica-name", "r2"])
    )
    assert (cfg.storage.adapter_store, cfg.storage.adapter_cache_bytes, cfg.observability.replica_name) == (
        "s3://b/p",
        512 * 2**20,
        "r2",
    )
    assert ServerConfig().storage.adapter_store is None and ServerConfig().storage.adapter_cache_bytes == 2 * 2**30
    args = worker.parse_args(["--redis-url", "redis://x", "--adapter-store", "s3://b/p", "--adapter-cache-bytes", "0"])
    assert (args.adapter_store, args.adapter_cache_bytes) == ("s3://b/p", 0)
    for parser in (serve, worker):
        with pytest.raises(SystemExit):
            parser.parse_args(["--redis-url", "redis://x", "--adapter-cache-bytes", "-1"])
        assert "a size must be >= 0 bytes, not -1" in capsys.readouterr().err
