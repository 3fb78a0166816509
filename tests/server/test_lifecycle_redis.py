"""Two servers on one shared store and a real Redis: a fine-tuning job trained by one is served by both, and
retire and rollback through either's admin API reach the other, over the skill-event bus, without a restart."""

from __future__ import annotations

import uuid
from dataclasses import replace

import torch
from fastapi.testclient import TestClient
from openai import OpenAI

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from skillpool.trainer.events import SkillRegistered
from skillpool.trainer.service import RedisEventBus
from tests.adapters_store.test_store import draft
from tests.conftest import until
from tests.datasets import dataset_dir


def test_retire_and_rollback_reach_every_server(redis_url, tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = ServerConfig.of(
        data_dir=tmp_path, redis_url=redis_url, redis_prefix=f"t-{uuid.uuid4().hex[:8]}", default_max_tokens=2
    )
    a = build_components(cfg, base=tiny_base, embedder=embedder)  # trains
    b = build_components(cfg.replace(run_trainer=False), base=tiny_base, embedder=embedder)  # only serves
    data = b"\n".join((dataset_dir("long_sequence", "sst-2") / "train.jsonl").read_bytes().splitlines()[:30])
    try:
        with TestClient(create_app(a)) as ha, TestClient(create_app(b)) as hb:
            ca = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=ha, max_retries=0)
            cb = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=hb, max_retries=0)
            f = cb.files.create(file=("s.jsonl", data), purpose="fine-tune")  # a file given to B, trained on A
            job = cb.fine_tuning.jobs.create(
                model="tiny-llama", training_file=f.id, hyperparameters={"n_epochs": 1}, metadata={"force": "true"}
            )
            until(lambda: ca.fine_tuning.jobs.retrieve(job.id).status == "succeeded", timeout=300)
            model = cb.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
            assert model is not None
            until(lambda: model in [m.id for m in cb.models.list()])

            cb.models.delete(model)  # retired on B ...
            until(lambda: model not in [m.id for m in ca.models.list()])  # ... A stops serving it
            assert a.pool.resolve(model) is None and not a.router.skills

            r = ha.post(f"/v1/models/{model}/rollback", json={})  # restored on A ...
            assert r.status_code == 200, r.text
            until(lambda: model in [m.id for m in cb.models.list()])  # ... B serves it again
            raw = cb.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
            assert raw.headers["x-skillpool-route"].endswith("=1.00")
    finally:
        a.close()
        b.close()


def test_a_retire_through_the_admin_api_reaches_a_second_server_through_the_bus(
    redis_url, tiny_base, embedder, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    cfg = ServerConfig.of(data_dir=tmp_path, redis_url=redis_url, redis_prefix=prefix, run_trainer=False)
    a = build_components(cfg, base=tiny_base, embedder=embedder)
    b = build_components(cfg, base=tiny_base, embedder=embedder)
    worker = RedisEventBus(redis_url, prefix)  # what `skillpool worker` publishes once it stored a skill
    keys = torch.from_numpy(embedder.embed(["a film review: great acting", "a film review: dull plot"]))
    skill = draft("shared-skill")  # stored as a worker stores one: keys of this embedder, this base model
    meta = {**skill.meta, "base_model": {"id": "tiny-llama", "fingerprint": tiny_base.fingerprint}}
    skill = replace(skill, meta=meta, router_tensors={"centroid_keys": keys, "threshold": torch.tensor([0.4])})
    try:
        rec = a.store.write(skill)  # the shared store: one data dir for both servers
        worker.publish(SkillRegistered(rec.name, rec.version))
        until(lambda: a.pool.get("shared-skill") is not None and b.pool.get("shared-skill") is not None)
        with TestClient(create_app(a)) as ha, TestClient(create_app(b)) as hb:
            assert ha.delete("/v1/models/shared-skill").status_code == 200  # retired on A ...
            until(lambda: b.pool.get("shared-skill") is None)  # ... B stops serving it
            assert "shared-skill" not in [m["id"] for m in hb.get("/v1/models").json()["data"]]
            assert b.store.serving("shared-skill") is None and not b.router.skills
            r = hb.post("/v1/models/shared-skill/rollback", json={})  # served again through B ...
            assert r.status_code == 200, r.text
            until(lambda: a.pool.get("shared-skill") is not None)  # ... and A follows
    finally:
        worker.close()
        a.close()
        b.close()
