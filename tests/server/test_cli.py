"""`skillpool serve`'s flags, generated from ServerConfig: one per field, the old spellings, the defaults."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from skillpool.router import RouterSettings
from skillpool.server.cli import add_arguments
from skillpool.server.config import ServerConfig

ENV = (
    "SKILLPOOL_API_KEY",
    "SKILLPOOL_ADMIN_KEY",
    "SKILLPOOL_API_KEYS_FILE",
    "SKILLPOOL_REDIS_URL",
    "SKILLPOOL_THREADS",
    "SKILLPOOL_DTYPE",
    "SKILLPOOL_ADAPTER_STORE",
    "SKILLPOOL_REPLICA",
)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skillpool serve")
    add_arguments(p)
    return p


def config(*argv: str) -> ServerConfig:
    return ServerConfig.from_cli_args(parser().parse_args(list(argv)))


def settings() -> set[str]:
    return {f.name for kind in ServerConfig.concerns().values() for f in fields(kind)}


def test_every_field_has_a_flag_with_help() -> None:
    dests = {a.dest for a in parser()._actions if a.option_strings}
    assert len(settings()) > 40 and settings() - {"router"} <= dests
    assert {"router", "keys", "top_k", "sapt_replay"} <= dests  # the router's, from skillpool.router.flags
    assert all(a.help for a in parser()._actions), [a.dest for a in parser()._actions if not a.help]
    text = parser().format_help()
    for flag in ("--data-dir", "--batch-window-ms", "--max-upload-mb", "--no-trainer", "--admin-key", "--router-top-k"):
        assert flag in text


def test_help_groups_the_flags_by_concern() -> None:
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser()._action_groups}
    for title, dests in (
        ("storage", {"data_dir", "adapter_store"}),
        ("model and engine", {"engine", "dtype", "max_batch_size"}),
        ("routing", {"embedder", "router", "top_k"}),
        ("training and jobs", {"redis_url", "run_trainer", "max_pending_jobs"}),
        ("http address, keys and limits", {"port", "api_keys_file", "max_waiting"}),
        ("cluster", {"replicas", "ray_address"}),
        ("observability", {"replica_name", "log_level"}),
        ("process", {"threads"}),
    ):
        assert dests <= groups[title], (title, groups.get(title))
    ungrouped = {a.dest for g in parser()._action_groups if g.title == "options" for a in g._group_actions}
    assert ungrouped == {"help"}  # every setting sits in its concern's group


def test_settings_are_found_by_name_whatever_their_concern() -> None:
    cfg = ServerConfig.of(port=9, engine="vllm", redis_url="redis://x")
    assert (cfg.http.port, cfg.serving.engine, cfg.training.redis_url) == (9, "vllm", "redis://x")
    assert cfg.replace(port=10).http.port == 10 and cfg.replace(port=10).serving == cfg.serving
    with pytest.raises(TypeError, match="no such server setting: colour"):
        ServerConfig.of(colour="red")
    assert len(settings()) == sum(len(fields(k)) for k in ServerConfig.concerns().values())  # names are unique


def test_defaults_are_the_dataclass_defaults() -> None:
    assert config() == ServerConfig()
    assert config().routing.router == RouterSettings()


def test_every_flag_name_used_before_sets_its_field() -> None:
    argv = [
        "--host", "0.0.0.0", "--port", "9000", "--data-dir", "d", "--model", "m", "--api-key", "k1",
        "--admin-api-key", "k2", "--api-keys-file", "keys.txt", "--device", "cpu", "--engine", "vllm",
        "--batch-window-ms", "25", "--max-batch-size", "3", "--max-batched-tokens", "64", "--max-waiting", "5",
        "--max-upload-mb", "1.5", "--max-request-mb", "2", "--max-loaded-skills", "2", "--prefix-cache-tokens", "0",
        "--max-loras", "2", "--max-cpu-loras", "6", "--max-lora-rank", "32", "--max-model-len", "1024",
        "--default-max-tokens", "7", "--redis-url", "redis://x", "--redis-prefix", "p", "--no-trainer",
        "--router-top-k", "3", "--router-format-gate", "off",
    ]  # fmt: skip
    cfg = config(*argv)
    assert cfg == ServerConfig.of(
        data_dir=Path("d"), model=Path("m"), host="0.0.0.0", port=9000, api_key="k1", admin_key="k2",
        api_keys_file=Path("keys.txt"), device="cpu", engine="vllm", batch_window_s=0.025, max_batch_size=3,
        max_batched_tokens=64, max_waiting=5, max_upload_bytes=int(1.5 * 2**20), max_request_bytes=2 * 2**20,
        max_loaded_skills=2, prefix_cache_tokens=0, max_loras=2, max_cpu_loras=6, max_lora_rank=32,
        max_model_len=1024, default_max_tokens=7, redis_url="redis://x", redis_prefix="p", run_trainer=False,
        router=cfg.routing.router,
    )  # fmt: skip
    assert cfg.routing.router.top_k == 3 and not cfg.routing.router.format.enabled


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        (["--admin-key", "k"], ["--admin-api-key", "k"]),
        (["--top-k", "2"], ["--router-top-k", "2"]),
        (["--router", "centroid"], ["--router-mode", "centroid"]),
        (["--keys", "4"], ["--router-keys", "4"]),
    ],
)
def test_aliases_parse_to_the_same_config(alias: list[str], canonical: list[str]) -> None:
    assert config(*alias) == config(*canonical) != config()


def test_new_flags_for_the_upload_and_queue_limits() -> None:
    cfg = config("--max-upload-examples", "50", "--min-upload-examples", "2", "--max-pending-jobs", "4")
    assert (cfg.training.max_upload_examples, cfg.training.min_upload_examples, cfg.training.max_pending_jobs) == (
        50,
        2,
        4,
    )
    assert (
        config().training.max_pending_jobs_per_key is None
        and config("--max-pending-jobs-per-key", "3").training.max_pending_jobs_per_key == 3
    )


def test_environment_gives_the_key_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKILLPOOL_API_KEY", "env-key")
    monkeypatch.setenv("SKILLPOOL_API_KEYS_FILE", "/etc/keys")
    monkeypatch.setenv("SKILLPOOL_REDIS_URL", "")  # compose's unset variable: no Redis
    cfg = config()
    assert (cfg.http.api_key, cfg.http.api_keys_file, cfg.training.redis_url) == ("env-key", Path("/etc/keys"), None)
    assert config("--api-key", "flag-key").http.api_key == "flag-key"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--port", "eighty"], "--port: invalid int value: 'eighty'"),
        (["--engine", "tgi"], "--engine: invalid choice: 'tgi'"),
        (["--max-upload-mb", "lots"], "--max-upload-mb: invalid float value: 'lots'"),
        (["--router-format-gate", "maybe"], "--router-format-gate/--format-gate: invalid choice: 'maybe'"),
        (["--kv-cache-memory-bytes", "lots"], "not a size: 'lots'"),
        (["--router-threads", "0"], "--router-threads: must be at least 1, not 0"),
        (["--routing-batch-size", "two"], "--routing-batch-size: not a whole number: 'two'"),
        (["--embedder", "openvino"], "--embedder: invalid choice: 'openvino'"),
        (["--engine-nice", "-5"], "--engine-nice: must be from 0 to 19, not -5"),
        (["--engine-nice", "20"], "--engine-nice: must be from 0 to 19, not 20"),
        (["--max-pending-jobs-per-key", "0"], "--max-pending-jobs-per-key: must be at least 1, not 0"),
    ],
)
def test_a_bad_value_is_an_argparse_error(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_memory_flags_take_vllms_names_and_sizes_with_units() -> None:
    assert config("--kv-cache-memory-bytes", "20GiB").serving.kv_cache_memory_bytes == 20 * 2**30
    assert config("--kv-cache-memory", "1000").serving.kv_cache_memory_bytes == 1000
    assert config("--gpu-memory-utilization", "0.5").serving.gpu_memory_utilization == 0.5
    assert (config().serving.kv_cache_memory_bytes, config().serving.gpu_memory_utilization) == (None, None)


def test_vllm_load_format_is_passed_through_as_given() -> None:
    assert config("--vllm-load-format", "dummy").serving.vllm_load_format == "dummy"
    assert config().serving.vllm_load_format is None


def test_routing_flags_pick_the_embedder_its_threads_and_the_batch_per_call() -> None:
    assert (config().routing.embedder, config().routing.router_threads, config().routing.routing_batch_size) == (
        "auto",
        2,
        None,
    )
    cfg = config("--embedder", "torch", "--router-threads", "3", "--routing-batch-size", "8")
    assert (cfg.routing.embedder, cfg.routing.router_threads, cfg.routing.routing_batch_size) == ("torch", 3, 8)


def test_the_engine_runs_at_the_server_s_priority_unless_asked() -> None:
    assert config().serving.engine_nice == 0  # a niced engine would yield to the in-process trainer as well
    assert config("--engine-nice", "5").serving.engine_nice == 5
