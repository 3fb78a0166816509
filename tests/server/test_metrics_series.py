"""/metrics follows the pool and the jobs: a retired skill leaves no per-skill series, a rollback shows the
served version's score, a job's progress series go when it ends, each request is observed once (probes and
scrapes not at all), and the engine's health and adapter loads are exported. Read through the real app."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from skillpool.adapters_store.store import SkillRecord
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.engines.hf import HEARTBEAT_S
from tests.adapters_store.test_store import draft
from tests.conftest import until
from tests.datasets import sst2_lines
from tests.server.test_engine import make_engine

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(http: TestClient) -> Samples:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def of_skill(samples: Samples, skill: str) -> set[str]:
    return {name for name, labels in samples if ("skill", skill) in labels}


def write_tiny_peft(folder: Path) -> None:
    """A rank-2 adapter the tiny LLaMA's q_proj (64 -> 64) takes."""
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 2)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def store_skill(components, embedder, name: str, metric: str, score: float) -> SkillRecord:  # type: ignore[no-untyped-def]
    """A version as a job stores one: this base model, this embedder's keys, held-out probe prompts."""
    texts = ["a film review: great acting", "a film review: dull plot"]
    keys = torch.from_numpy(embedder.embed(texts))
    d = draft(name, writer=write_tiny_peft)
    base = {"id": components.base.model_id, "fingerprint": components.base.fingerprint}
    meta = {**d.meta, "base_model": base, "eval": {"metric": metric, "score": score}}
    probe = [{"messages": [{"role": "user", "content": t}], "answer": "x", "route_text": t} for t in texts]
    tensors = {"centroid_keys": keys, "threshold": torch.tensor([0.4])}
    return components.store.write(replace(d, meta=meta, router_tensors=tensors, probe=probe))


def test_a_retired_skill_leaves_no_series_and_a_rollback_shows_its_version_s_score(
    client: TestClient, components, embedder
) -> None:  # type: ignore[no-untyped-def]
    store_skill(components, embedder, "reviews", "accuracy", 0.5)
    components.pool.register(store_skill(components, embedder, "reviews", "exact_match", 0.75))
    m = scrape(client)
    assert value(m, "skillpool_skill_eval_score", skill="reviews", metric="exact_match") == 0.75
    assert value(m, "skillpool_routing_accuracy", skill="reviews") is not None

    assert client.post("/v1/models/reviews/rollback", json={"version": 1}).status_code == 200
    m = scrape(client)
    assert value(m, "skillpool_skill_eval_score", skill="reviews", metric="accuracy") == 0.5
    assert value(m, "skillpool_skill_eval_score", skill="reviews", metric="exact_match") is None  # replaced

    assert client.delete("/v1/models/reviews").status_code == 200
    assert of_skill(scrape(client), "reviews") == set()  # accuracy, eval score: every per-skill gauge
    assert client.post("/v1/models/reviews/rollback", json={}).status_code == 200  # back: its series too
    m = scrape(client)
    assert value(m, "skillpool_skill_eval_score", skill="reviews", metric="exact_match") == 0.75
    assert value(m, "skillpool_routing_accuracy", skill="reviews") is not None


def test_an_adapter_is_counted_when_the_engine_loads_it(client: TestClient, components, embedder) -> None:  # type: ignore[no-untyped-def]
    components.pool.register(store_skill(components, embedder, "loaded", "accuracy", 0.5))
    tier = lambda name: {"tier": name, "replica": components.metrics.replica}  # noqa: E731
    before = scrape(client)
    assert value(before, "skillpool_adapter_loads_total", **tier("gpu")) is not None
    for _ in range(2):  # the first use loads it; the second finds it resident
        body = {"model": "loaded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    after = scrape(client)
    for name, kind, more in (("loads", "gpu", 1), ("hits", "gpu", 1), ("hits", "store", 1)):  # read from the data dir
        series = f"skillpool_adapter_{name}_total"
        assert value(after, series, **tier(kind)) == value(before, series, **tier(kind)) + more, (name, kind)  # type: ignore[operator]
    assert value(after, "skillpool_adapter_hits_total", **tier("disk")) is None  # no disk cache before a folder


def test_each_request_is_observed_once_and_probes_and_scrapes_not_at_all(client: TestClient) -> None:
    chat = "/v1/chat/completions"
    before = scrape(client)
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert client.post(chat, json=body).status_code == 200
    with client.stream("POST", chat, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert client.get(probe).status_code == 200
    after = scrape(client)
    for name in ("skillpool_request_duration_seconds_count", "skillpool_requests_total"):
        labels = {"endpoint": chat} | ({"status": "200"} if name == "skillpool_requests_total" else {})
        assert (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0) == 2, name
    endpoints = {dict(labels).get("endpoint") for name, labels in after if name.startswith("skillpool_request")}
    assert not endpoints & {"/healthz", "/readyz", "/metrics"}


def test_a_job_s_progress_is_exported_while_it_runs_and_removed_when_it_ends(client: TestClient) -> None:
    r = client.post(
        "/tasks", files={"file": ("s.jsonl", sst2_lines(200))}, data={"name": "long", "config": '{"epochs": 20}'}
    )
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    until(lambda: (client.get(f"/tasks/{job}").json()["progress"]["step"] or 0) >= 1, timeout=300)
    m = scrape(client)
    assert value(m, "skillpool_training_jobs_running") == 1 and value(m, "skillpool_training_jobs_queued") == 0
    assert value(m, "skillpool_trainer_up", queue="local") == 1
    steps = value(m, "skillpool_training_steps", skill="long")
    assert steps is not None and 1 <= (value(m, "skillpool_training_step", skill="long") or 0) <= steps
    assert {"skillpool_training_tokens_per_second", "skillpool_training_loss"} <= of_skill(m, "long")
    cancelled = value(m, "skillpool_training_jobs_total", status="cancelled") or 0

    assert client.delete(f"/tasks/{job}").status_code == 200
    until(lambda: client.get(f"/tasks/{job}").json()["status"] == "cancelled", timeout=300)
    m = scrape(client)
    assert of_skill(m, "long") == set()
    assert value(m, "skillpool_training_jobs_total", status="cancelled") == cancelled + 1
    assert value(m, "skillpool_training_jobs_running") == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected crash
def test_the_engine_s_health_alive_and_after_its_loop_died(components, tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as http:  # the module's engine: alive, idle, still ticking
        until(lambda: (value(scrape(http), "skillpool_engine_last_step_age_seconds") or 1e9) < 2 * HEARTBEAT_S)
        assert value(scrape(http), "skillpool_engine_up") == 1

    engine = make_engine(tiny_base)
    c = build_components(components.cfg.replace(data_dir=tmp_path), base=tiny_base, engine=engine, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:

            def crash() -> bool:
                raise RuntimeError("injected: the loop itself fails")

            engine._apply_all = crash  # type: ignore[method-assign]  # the idle loop's next tick runs it
            until(lambda: not engine.healthy())
            m = scrape(http)
            assert value(m, "skillpool_engine_up") == 0
            age = value(m, "skillpool_engine_last_step_age_seconds")
            until(
                lambda: (value(scrape(http), "skillpool_engine_last_step_age_seconds") or 0) > (age or 0) + HEARTBEAT_S
            )
    finally:
        c.close()
