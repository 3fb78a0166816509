"""`skillpool serve --replicas` fails fast and clearly before anything starts: without Ray the error names the
install command, an unreachable --ray-address is reported within the connect timeout, and cluster flags without
--replicas, or more than one ingress replica without Redis, are refused naming the flag."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from skillpool.server.cluster import launch
from skillpool.server.config import ServerConfig


def closed_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_without_ray_the_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as with no extra installed
    with pytest.raises(SystemExit, match=r"pip install -e \.\[cluster\].*bash setup\.sh --cluster"):
        launch.require_ray()


def test_serve_with_replicas_and_no_ray_stops_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from skillpool.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)
    loaded: list[str] = []
    monkeypatch.setattr("skillpool.server.bootstrap.build_components", lambda *a, **k: loaded.append("started"))
    with pytest.raises(SystemExit, match=r"--replicas needs Ray Serve.*pip install -e \.\[cluster\]"):
        main(["serve", "--replicas", "2", "--data-dir", str(tmp_path)])
    assert loaded == []


def test_an_unreachable_ray_address_is_a_clear_error() -> None:
    address = f"127.0.0.1:{closed_port()}"
    with pytest.raises(SystemExit, match=f"cannot reach the Ray cluster at --ray-address {address}"):
        launch.probe(address)  # refused at once here; a host that never answers is given up after CONNECT_S


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [("10.0.0.5:6379", ("10.0.0.5", 6379)), ("ray://head.svc:10001", ("head.svc", 10001)), ("auto", None)],
)
def test_ray_addresses_name_their_endpoint(address: str, endpoint: tuple[str, int] | None) -> None:
    assert launch.gcs_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["head.svc", "ray://head.svc", "10.0.0.5:port"])
def test_an_address_without_a_port_is_refused(address: str) -> None:
    with pytest.raises(SystemExit, match="port"):
        launch.gcs_endpoint(address)


def test_cluster_flags_need_replicas_and_several_ingresses_need_redis(tmp_path: Path) -> None:
    cfg = ServerConfig.of(data_dir=tmp_path)
    with pytest.raises(SystemExit, match="--ray-address only apply with --replicas"):
        launch.check_flags(cfg.replace(ray_address="10.0.0.5:6379"))
    with pytest.raises(SystemExit, match="--affinity-group-size only apply with --replicas"):
        launch.check_flags(cfg.replace(affinity_group_size=64))
    with pytest.raises(SystemExit, match="--ingress-replicas above 1 needs --redis-url"):
        launch.check_flags(cfg.replace(replicas=2, ingress_replicas=2))
    launch.check_flags(cfg.replace(replicas=2, ingress_replicas=2, redis_url="redis://127.0.0.1:6379/0"))
    launch.check_flags(cfg.replace(replicas=4))


def test_the_cluster_flags_parse_and_check_their_values() -> None:
    import argparse

    p = argparse.ArgumentParser()
    ServerConfig.add_cli_args(p)
    cfg = ServerConfig.from_cli_args(
        p.parse_args(["--replicas", "4", "--ingress-replicas", "2", "--replica-gpus", "0.25"])
    )
    assert (cfg.cluster.replicas, cfg.cluster.ingress_replicas, cfg.cluster.replica_gpus) == (4, 2, 0.25)
    assert ServerConfig.from_cli_args(p.parse_args([])).cluster.replicas is None  # the default: one process, as before
    assert ServerConfig.from_cli_args(p.parse_args([])).cluster.affinity_group_size == 1  # keys by skill, as before
    assert ServerConfig.from_cli_args(p.parse_args(["--affinity-group-size", "32"])).cluster.affinity_group_size == 32
    for bad in (["--replicas", "0"], ["--replica-gpus", "1.5"], ["--replica-gpus", "nan"], ["--replica-gpus", "0"],
                ["--affinity-group-size", "0"], ["--affinity-group-size", "-3"]):  # fmt: skip
        with pytest.raises(SystemExit):
            p.parse_args(bad)
