"""The GPU memory plan's arithmetic, on the CPU: numbers in, a utilization or a clear error out."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from skillpool.server.memory import (
    GIB,
    MemoryPlanError,
    ModelShape,
    kv_bytes_per_token,
    plan_vllm,
    trainer_need,
    vllm_need,
)
from skillpool.trainer.config import TrainConfig

# LLaMA-2-7B's config (the GPU memory plan's worked example), built here: no checkpoint needed for arithmetic
LLAMA_7B = ModelShape.from_config(
    LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
)
H100, H200 = 80 * 10**9, 141 * 10**9  # bytes the cards report (decimal GB)


def test_shape_counts_llama_7b_parameters() -> None:
    assert LLAMA_7B.head_dim == 128 and LLAMA_7B.kv_heads == 32
    assert 6.7e9 < LLAMA_7B.params < 6.8e9  # LLaMA-2-7B has 6.74B


def test_kv_bytes_per_token_is_two_layers_heads_dim_dtype() -> None:
    assert kv_bytes_per_token(LLAMA_7B, 2) == 2 * 32 * 32 * 128 * 2  # 512 KiB a token in bf16
    gqa = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=100)
    assert kv_bytes_per_token(gqa, 4) == 2 * 2 * 2 * 16 * 4


def test_checkpointing_cuts_the_trainer_activations() -> None:
    off = trainer_need(LLAMA_7B, TrainConfig())  # "auto" is off on a GPU
    on = trainer_need(LLAMA_7B, TrainConfig(gradient_checkpointing="on"))
    assert on.activations * 5 < off.activations
    assert off.weights == on.weights == LLAMA_7B.params * 4  # the trainer loads float32
    assert trainer_need(LLAMA_7B, TrainConfig(batch_size=16)).activations == 2 * off.activations


def test_no_trainer_gives_vllm_its_default() -> None:
    plan = plan_vllm(H100, H100, LLAMA_7B, 2, 4096, None)
    assert plan.utilization == 0.9 and plan.trainer is None


def test_7b_trainer_with_default_settings_does_not_fit_beside_vllm_on_80gb() -> None:
    with pytest.raises(MemoryPlanError) as e:
        plan_vllm(H100, H100, LLAMA_7B, 2, 4096, TrainConfig())
    assert "--no-trainer" in str(e.value) and "skillpool worker" in str(e.value)
    assert "trainer alone needs about 76" in str(e.value)  # GiB: float32 weights and activations at 8 × 512


def test_7b_trainer_with_checkpointing_leaves_vllm_part_of_80gb() -> None:
    plan = plan_vllm(H100, H100, LLAMA_7B, 2, 4096, TrainConfig(gradient_checkpointing="on"))
    assert 0.5 < plan.utilization < 0.65
    assert H100 * plan.utilization >= vllm_need(LLAMA_7B, 2, 4096)


def test_auto_utilization_leaves_the_trainer_its_estimate() -> None:
    train = TrainConfig()
    plan = plan_vllm(H200, H200, LLAMA_7B, 2, 4096, train)
    assert plan.trainer is not None
    assert H200 * plan.utilization + plan.trainer.total + GIB <= H200
    assert H200 * plan.utilization >= vllm_need(LLAMA_7B, 2, 4096)


def test_an_explicit_utilization_that_crowds_out_the_trainer_names_the_flag() -> None:
    with pytest.raises(MemoryPlanError, match="--gpu-memory-utilization 0.90"):
        plan_vllm(H200, H200, LLAMA_7B, 2, 4096, TrainConfig(), utilization=0.9)


def test_memory_other_processes_hold_counts_against_the_room() -> None:
    train = TrainConfig(gradient_checkpointing="on")
    alone = plan_vllm(H100, H100, LLAMA_7B, 2, 4096, train)
    shared = plan_vllm(H100, H100 - 10 * GIB, LLAMA_7B, 2, 4096, train)
    assert shared.utilization < alone.utilization


def test_utilization_out_of_range_is_refused() -> None:
    with pytest.raises(MemoryPlanError, match=r"\(0, 1\]"):
        plan_vllm(H100, H100, LLAMA_7B, 2, 4096, None, utilization=1.5)


def test_more_than_is_free_is_refused() -> None:
    with pytest.raises(MemoryPlanError, match="free"):
        plan_vllm(H100, H100 // 2, LLAMA_7B, 2, 4096, None)


def test_serve_reads_the_gpu_and_stops_with_the_numbers(tiny_base, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The wiring on a CPU machine: the GPU's free and total bytes are the one input faked (there is no GPU)."""
    import torch

    from skillpool.server.bootstrap import vllm_utilization
    from skillpool.server.config import ServerConfig

    cfg = ServerConfig.of(data_dir=tmp_path, device="cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * 10**9, 80 * 10**9))
    util = vllm_utilization(cfg, tiny_base)
    assert util is not None and 0.9 < util < 1  # a tiny model's trainer leaves vLLM nearly all of it
    assert vllm_utilization(cfg.replace(run_trainer=False), tiny_base) == 0.9
    assert vllm_utilization(cfg.replace(device="cpu", gpu_memory_utilization=0.5), tiny_base) == 0.5  # ignored
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (GIB // 2, GIB // 2))
    with pytest.raises(SystemExit, match="--no-trainer"):
        vllm_utilization(cfg, tiny_base)
