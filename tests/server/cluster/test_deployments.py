"""The deployments' settings: the KubeRay manifest's flags parse into a spec (so the manifest stays valid as flags
change), the engine replicas book a GPU on CUDA and their threads' CPUs otherwise, the multiplexed keys per
replica follow the engine's resident skills, and the replicas get the short matching timeout."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the cluster extra: pip install -e .[cluster]")

from skillpool.server.cluster.deployments import ClusterSpec, parse_flags  # noqa: E402
from skillpool.server.config import ServerConfig  # noqa: E402

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "kuberay" / "skillpool-rayservice.yaml"


def test_the_kuberay_manifests_flags_make_a_spec() -> None:
    service = yaml.safe_load(MANIFEST.read_text())
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "skillpool.server.cluster.deployments:app_builder"
    spec, _ = parse_flags(app["args"]["flags"])
    assert (spec.replicas, spec.ingress_replicas, spec.cfg.serving.engine, spec.cfg.training.run_trainer) == (
        4,
        2,
        "vllm",
        False,
    )
    engine = spec.engine_options()
    assert engine["ray_actor_options"]["num_gpus"] == 1 and engine["num_replicas"] == 4
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == 1


def test_the_kuberay_pods_outlast_serves_own_drain_of_a_replica() -> None:
    from skillpool.server.stopping import CLOSE_BUDGET_S

    service = yaml.safe_load(MANIFEST.read_text())
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    spec, _ = parse_flags(app["args"]["flags"])
    timeout = spec.cfg.http.shutdown_timeout_s
    assert spec.engine_options()["graceful_shutdown_timeout_s"] == timeout
    assert spec.ingress_options()["graceful_shutdown_timeout_s"] == timeout
    cluster = service["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] >= timeout + CLOSE_BUDGET_S


def test_flags_without_replicas_are_not_an_application() -> None:
    with pytest.raises(SystemExit, match="--replicas"):
        parse_flags("--engine hf")
    spec, _ = parse_flags("--replicas 2 --affinity-group-size 16")
    assert spec.cfg.cluster.affinity_group_size == 16  # what the ingress replicas key by


def test_replica_resources_keys_and_environment(tmp_path: Path) -> None:
    cfg = ServerConfig.of(data_dir=tmp_path, device="cpu")
    spec = ClusterSpec(cfg, replicas=2, threads=3)
    actor = spec.engine_options()["ray_actor_options"]
    assert actor["num_cpus"] == 3 and "num_gpus" not in actor
    env = actor["runtime_env"]["env_vars"]
    assert float(env["RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S"]) < 1.0  # below Ray's 1 s default
    assert spec.engine_options()["max_ongoing_requests"] == cfg.serving.max_batch_size
    assert spec.ingress_options()["ray_actor_options"]["num_cpus"] == 0
    assert spec.models_per_replica == 64
    assert replace(spec, cfg=cfg.replace(max_loaded_skills=8)).models_per_replica == 8
    vllm = cfg.replace(engine="vllm", device="cuda", max_loras=4, max_cpu_loras=16, replica_gpus=0.25)
    assert replace(spec, cfg=vllm).models_per_replica == 16
    assert replace(spec, cfg=vllm).engine_options()["ray_actor_options"]["num_gpus"] == 0.25
