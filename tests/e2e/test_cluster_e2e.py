"""`skillpool serve --replicas 2 --ingress-replicas 2` on a real local Ray (started here, 2 CPUs) with the real
SmolLM2, through the openai client over real HTTP: the same greedy answers as one process (base, a forced skill,
mixes, streaming); requests whose heaviest skill is the same land on the replica holding it; a skill registered
during the run is served by both replicas; a new version swaps a replica's copy on the event, even where it is only
a mix's secondary skill; a rollback and a retire return after every replica dropped the old version, and a retired
skill answers 404 on every replica, even to an ingress that still routes to it; each engine replica's adapter tiers
are exported under its own id, and every ingress follows the keys file without a signal."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import start_redis, until
from tests.synthetic import random_skills, write_store

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="the cluster extra: pip install -e .[cluster]")

# alpha..delta serve in the cluster; epsilon's weights become gamma v2 during the run (its answers are gamma v2's)
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon")
MODELS = {
    "base": "base",
    "forced": "alpha",
    "mix": "alpha=0.7,beta=0.3",
    "delta_on_alpha": "alpha=0.6,delta=0.4",
    "delta_on_beta": "beta=0.6,delta=0.4",
    "gamma_second": "alpha=0.7,gamma=0.3",
}
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
KEYS = "ops admin k-admin\ntester chat k-chat\n"  # the keys file the cluster starts with
ADMIN, USER = {"Authorization": "Bearer k-admin"}, {"Authorization": "Bearer k-chat"}


def adapters(smollm: Any) -> dict[str, Any]:
    """Random rank-4 LoRAs with weight enough (alpha 256) to change SmolLM2's greedy answer."""
    config = json.loads((smollm.path / "config.json").read_text())
    made = random_skills(config, len(NAMES), rank=4, seed=7, alpha=256.0)
    return {name: adapter for name, (_, adapter) in zip(NAMES, made)}


def chat(url: str, model: str, stream: bool = False) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="k-chat", max_retries=0, timeout=120)
    if stream:
        parts = client.chat.completions.create(model=model, messages=PROMPT, temperature=0, stream=True)  # type: ignore[call-overload]
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    r = client.chat.completions.create(model=model, messages=PROMPT, temperature=0)  # type: ignore[call-overload]
    return str(r.choices[0].message.content)


@pytest.fixture(scope="module")
def skills(smollm: Any) -> dict[str, Any]:
    return adapters(smollm)


@pytest.fixture(scope="module")
def reference(skills: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every answer from one `skillpool serve` process, gamma v2's under epsilon's name."""
    data = tmp_path_factory.mktemp("one-process")
    write_store(data, skills.items())
    out = {}
    with ServerProcess(data, ["--default-max-tokens", "8", "--threads", "1"]) as srv:
        for case, model in MODELS.items():
            out[case] = chat(srv.url, model)
        out["gamma_v2_second"] = chat(srv.url, "alpha=0.7,epsilon=0.3")
    assert len({out["base"], out["forced"], out["mix"]}) == 3, out  # the skills change the answer: the test can fail
    return out


class Cluster:
    def __init__(self, srv: ServerProcess, data: Path, redis_url: str) -> None:
        self.srv, self.data, self.redis_url = srv, data, redis_url
        from skillpool.server.cluster.hub import hub_handle

        self.hub = hub_handle("skillpool-hub")

    def replicas(self) -> dict[str, dict[str, Any]]:
        return dict(ray.get(self.hub.replicas.remote()))

    def holder(self, key: str) -> str:
        """The one replica that served requests keyed `key` (fails if none or several did)."""
        served = {r: v["served"].get(key, 0) for r, v in self.replicas().items()}
        holders = [r for r, n in served.items() if n]
        assert len(holders) == 1, served
        return holders[0]

    def announce(self, name: str, version: int) -> None:
        from skillpool.trainer.events import SkillRegistered
        from skillpool.trainer.service import RedisEventBus

        bus = RedisEventBus(self.redis_url)
        bus.publish(SkillRegistered(name, version))  # what `skillpool worker` does after storing a version
        bus.close()


@pytest.fixture(scope="module")
def cluster(
    skills: dict[str, Any], reference: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    data = tmp_path_factory.mktemp("cluster")
    write_store(data, [(n, skills[n]) for n in ("alpha", "beta", "gamma")])
    redis_proc, redis_url = start_redis(tmp_path_factory.mktemp("redis"))
    ray.init(num_cpus=2, include_dashboard=False, namespace="skillpool")
    gcs = ray.get_runtime_context().gcs_address
    args = ["--replicas", "2", "--ingress-replicas", "2", "--threads", "1", "--ray-address", gcs]
    args += ["--redis-url", redis_url, "--default-max-tokens", "8"]
    (data.parent / "keys").write_text(KEYS)
    args += ["--api-keys-file", str(data.parent / "keys")]
    srv = ServerProcess(data, args, startup_s=480)
    try:
        with srv:
            until(lambda: len(Cluster(srv, data, redis_url).replicas()) == 2, timeout=60)
            yield Cluster(srv, data, redis_url)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def test_two_replicas_answer_as_one_process(cluster: Cluster, reference: dict[str, str]) -> None:
    for case in ("base", "forced", "mix"):
        assert chat(cluster.srv.url, MODELS[case]) == reference[case], case
    assert chat(cluster.srv.url, MODELS["forced"], stream=True) == reference["forced"]


def test_requests_with_the_same_heaviest_skill_land_on_the_replica_holding_it(
    cluster: Cluster, reference: dict[str, str]
) -> None:
    for model in ("alpha", "alpha=0.7,beta=0.3", "alpha=0.7,gamma=0.3", "alpha") * 2:
        chat(cluster.srv.url, model)
    until(lambda: sum(v["served"].get("alpha#v1", 0) for v in cluster.replicas().values()) >= 9, timeout=10)
    alpha = cluster.holder("alpha#v1")
    for _ in range(3):  # a key no replica holds goes to the one holding fewest: the other
        chat(cluster.srv.url, "beta")
    until(lambda: sum(v["served"].get("beta#v1", 0) for v in cluster.replicas().values()) >= 3, timeout=10)
    assert cluster.holder("beta#v1") != alpha
    assert cluster.replicas()[alpha]["versions"].get("gamma") == 1  # held as a mix's secondary skill


def test_a_skill_registered_during_the_run_is_served_by_both_replicas(
    cluster: Cluster, skills: dict[str, Any], reference: dict[str, str]
) -> None:
    write_store(cluster.data, [("delta", skills["delta"])])
    cluster.announce("delta", 1)

    def listed_everywhere() -> bool:  # each call reaches one of the two ingress replicas
        return all("delta" in httpx.get(cluster.srv.url + "/v1/models", headers=USER).text for _ in range(6))

    until(listed_everywhere, timeout=10)
    assert chat(cluster.srv.url, MODELS["delta_on_alpha"]) == reference["delta_on_alpha"]
    assert chat(cluster.srv.url, MODELS["delta_on_beta"]) == reference["delta_on_beta"]
    until(lambda: all(v["versions"].get("delta") == 1 for v in cluster.replicas().values()), timeout=10)


def test_a_new_version_swaps_a_secondary_copy_on_the_event_and_a_rollback_waits_for_every_replica(
    cluster: Cluster, skills: dict[str, Any], reference: dict[str, str]
) -> None:
    alpha = cluster.holder("alpha#v1")
    write_store(cluster.data, [("gamma", skills["epsilon"])])
    cluster.announce("gamma", 2)
    until(lambda: cluster.replicas()[alpha]["versions"].get("gamma") == 2, timeout=10)  # before any request for it
    assert chat(cluster.srv.url, MODELS["gamma_second"]) == reference["gamma_v2_second"]
    r = httpx.post(cluster.srv.url + "/v1/models/gamma/rollback", json={"version": 1}, headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    assert cluster.replicas()[alpha]["versions"].get("gamma") == 1  # already swapped back when the call returned
    assert chat(cluster.srv.url, MODELS["gamma_second"]) == reference["gamma_second"]


def test_a_retired_skill_answers_404_on_every_replica_even_from_a_stale_ingress(cluster: Cluster, smollm: Any) -> None:
    from ray import serve

    from skillpool.adapters_store.store import SkillStore
    from skillpool.server.cluster.remote_engine import RemoteEngine
    from skillpool.server.engines import EngineRequest, Mix, SamplingParams

    # an ingress that will not hear of the retire: it keeps routing to delta v1
    stale = RemoteEngine(serve.get_deployment_handle("SkillpoolEngine", "skillpool"), smollm.path, cluster.hub)
    stale.start_blocking()
    store = SkillStore(cluster.data)
    for name in ("alpha", "beta", "delta"):
        rec = store.get(name, 1)
        assert rec is not None
        stale.add_skill(name, rec.adapter)

    r = httpx.delete(cluster.srv.url + "/v1/models/delta", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert all("delta" not in v["versions"] for v in cluster.replicas().values())  # dropped before it returned
    for model in ("delta", MODELS["delta_on_alpha"], MODELS["delta_on_beta"]) * 2:
        r = httpx.post(
            cluster.srv.url + "/v1/chat/completions",
            json={"model": model, "messages": PROMPT},
            headers=USER,
            timeout=60,
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text

    async def ask(mix: dict[str, float], i: int) -> Any:
        prompt = stale.encode_chat(PROMPT)
        request = EngineRequest(f"stale-{i}", prompt, SamplingParams(max_tokens=4, temperature=0), Mix.of(mix))
        return [ev async for ev in stale.generate(request)]

    async def both() -> list[Any]:  # keyed by alpha and by beta: one request on each replica
        return await asyncio.gather(ask({"alpha": 0.6, "delta": 0.4}, 0), ask({"beta": 0.6, "delta": 0.4}, 1))

    for events in asyncio.run(both()):
        assert len(events) == 1 and events[0].not_found and "delta" in (events[0].error or "")


def test_a_skill_sent_by_value_serves_as_its_stored_copy_does(cluster: Cluster, smollm: Any) -> None:
    """What the quality gate does at an ingress: a candidate not in the store goes to a replica by value."""
    import threading

    from ray import serve

    from skillpool.adapters_store.store import SkillStore
    from skillpool.server.cluster.remote_engine import RemoteEngine
    from skillpool.server.engines import EngineEvent, EngineRequest, Mix, SamplingParams

    engine = RemoteEngine(serve.get_deployment_handle("SkillpoolEngine", "skillpool"), smollm.path, cluster.hub)
    engine.start_blocking()
    rec = SkillStore(cluster.data).get("alpha", 1)
    assert rec is not None
    engine.add_skill("alpha", rec.adapter)
    engine.add_skill("alpha@candidate-0", lambda: rec.adapter())  # not a store reference: sent by value
    prompt = engine.encode_chat(PROMPT)
    texts: dict[str, str] = {}
    for name in ("alpha", "alpha@candidate-0"):
        parts: list[str] = []
        done = threading.Event()

        def sink(ev: EngineEvent, parts: list[str] = parts, done: threading.Event = done) -> None:
            parts.append(ev.text)
            if ev.finish_reason is not None:
                assert ev.finish_reason == "length", ev.error
                done.set()

        engine.submit(
            EngineRequest(f"v-{name}", prompt, SamplingParams(max_tokens=6, temperature=0), Mix.of({name: 1.0})), sink
        )
        assert done.wait(120)
        texts[name] = "".join(parts)
    assert texts["alpha@candidate-0"] == texts["alpha"] != ""
    until(lambda: any(v["versions"].get("alpha@candidate-0") == 0 for v in cluster.replicas().values()), timeout=10)
    engine.remove_skill("alpha@candidate-0")  # returns once every replica dropped it
    assert all("alpha@candidate-0" not in v["versions"] for v in cluster.replicas().values())


def test_each_engine_replicas_adapter_tiers_are_exported_under_its_own_id(cluster: Cluster) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def tiers() -> dict[tuple[str, str], float]:
        text = httpx.get(cluster.srv.url + "/metrics", headers=ADMIN, timeout=30).text
        return {
            (s.labels["replica"], s.labels["tier"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "skillpool_adapter_hits_total"
        }

    replicas = cluster.replicas()

    def exported() -> bool:  # as the hub has them (the ingress reads them at most once a second)
        got, now = tiers(), cluster.replicas()
        return all(got.get((r, "gpu")) == now[r]["stats"]["adapter_hits"] for r in now)

    until(exported, timeout=10)
    got = tiers()
    for r in replicas:  # both replicas read skills from the store in the tests before
        assert got[(r, "store")] >= 1, got
    ingresses = {r for r, _ in got} - set(replicas)
    assert ingresses and all(got.get((r, "gpu")) is None for r in ingresses)  # an ingress holds no adapters


def test_every_ingress_follows_the_keys_file_and_a_sighup_does_not_stop_the_cluster(cluster: Cluster) -> None:
    keys = cluster.data.parent / "keys"
    url = cluster.srv.url + "/v1/models"
    alice = {"Authorization": "Bearer k-alice"}

    def everywhere(status: int, headers: dict[str, str]) -> bool:  # each call reaches one of the ingresses
        return all(httpx.get(url, headers=headers, timeout=30).status_code == status for _ in range(6))

    assert everywhere(200, USER) and everywhere(401, alice)
    try:
        keys.write_text("ops admin k-admin\nalice chat k-alice\n")  # tester's key withdrawn, alice's added
        until(lambda: everywhere(401, USER), timeout=10)
        assert everywhere(200, alice)
        assert cluster.srv.proc is not None
        os.kill(cluster.srv.proc.pid, signal.SIGHUP)
        until(lambda: "re-read the keys file" in cluster.srv.log_tail(), timeout=10)
        assert cluster.srv.proc.poll() is None
    finally:
        keys.write_text(KEYS)
    until(lambda: everywhere(200, USER), timeout=10)
    assert everywhere(401, alice)
