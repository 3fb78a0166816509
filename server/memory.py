"""GPU memory plans from a model's shape: what vLLM may take beside the in-process trainer, and KV bytes per token.

Pure arithmetic on numbers (total and free bytes, the model config, dtypes, the trainer's settings), so every
decision is testable on a CPU; bootstrap.py reads the numbers from torch.cuda and calls these. The trainer's
need is an estimate, not a measurement (the formula and what it leaves out: docs/serving.md#the-gpu-memory-plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from skillpool.trainer.config import TrainConfig

GIB = 2**30
OVERHEAD = GIB  # CUDA contexts (server, vLLM's engine process), the allocator's slack and MiniLM, together
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's own default (0.24; 0.32's is 0.92): used when no trainer shares the GPU
VLLM_ACTIVATIONS = 2 * GIB  # vLLM's profiled forward peak and CUDA graphs beyond weights and KV, at 7B scale


class MemoryPlanError(ValueError):
    """The engine and the trainer cannot both fit this GPU as configured; the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a LLaMA-family config the estimates need."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(config.intermediate_size),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            vocab=int(config.vocab_size),
        )

    @property
    def params(self) -> int:
        """Parameters: per layer q,o (hidden²), k,v (hidden × kv width), the MLP's three matrices, two norms;
        embeddings and the LM head counted apart (untied, the 7B case: a tied head overcounts by vocab × hidden)."""
        kv = self.kv_heads * self.head_dim
        layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate
        return self.layers * (layer + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes


@dataclass(frozen=True)
class TrainerNeed:
    """The in-process trainer's estimated peak, in parts (bytes)."""

    weights: int  # the base model as the trainer loads it (float32: trainer/skill_trainer.py)
    activations: int  # what backward keeps for one padded batch of batch_size × max_seq_len tokens
    logits: int  # the answer tokens' logits, their float copy and softmax gradient
    lora: int  # LoRA weights, gradients and AdamW's two moments

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.logits + self.lora


def trainer_need(shape: ModelShape, train: TrainConfig, cuda: bool = True, dtype_bytes: int = 4) -> TrainerNeed:
    """The trainer's peak for one job with these settings (the defaults: the upload's may differ).

    Per token and layer, backward keeps about 12 × hidden + 2 × kv width + 4 × intermediate values without
    checkpointing (norm inputs and outputs, q and attention output, LoRA dropout inputs, k and v, the MLP's
    gate, up, activation and product); with it, each layer's input plus one layer's full set.
    """
    tokens = train.batch_size * train.max_seq_len
    kv = shape.kv_heads * shape.head_dim
    per_layer = 12 * shape.hidden + 2 * kv + 4 * shape.intermediate
    checkpointing = {"on": True, "off": False}.get(train.gradient_checkpointing, not cuda)  # "auto": CPU only
    per_token = shape.hidden * shape.layers + per_layer if checkpointing else per_layer * shape.layers
    targets = len(train.target_modules)
    lora = targets * shape.layers * train.rank * 2 * shape.hidden * 4 * 4  # fp32 weights, grads, 2 moments
    return TrainerNeed(
        weights=shape.params * dtype_bytes,
        activations=tokens * per_token * dtype_bytes,
        logits=tokens * shape.vocab * 4 * 3,
        lora=lora,
    )


def vllm_need(shape: ModelShape, dtype_bytes: int, max_model_len: int) -> int:
    """The least vLLM can serve with: its weights, KV for one sequence of max_model_len, activations."""
    return shape.params * dtype_bytes + kv_bytes_per_token(shape, dtype_bytes) * max_model_len + VLLM_ACTIVATIONS


@dataclass(frozen=True)
class VLLMPlan:
    utilization: float  # what vLLM is given (gpu_memory_utilization)
    trainer: TrainerNeed | None  # None: no trainer in this process


def need_batch(train: TrainConfig | None) -> str:
    return f"{train.batch_size} × {train.max_seq_len} tokens" if train is not None else "none"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def plan_vllm(
    total: int,
    free: int,
    shape: ModelShape,
    dtype_bytes: int,
    max_model_len: int,
    train: TrainConfig | None,
    utilization: float | None = None,
) -> VLLMPlan:
    """vLLM's gpu_memory_utilization on a GPU of `total` bytes with `free` free now, leaving room for the
    in-process trainer (`train`: its settings; None: it runs elsewhere). `utilization` None: the most that
    leaves the trainer its estimate. Raises MemoryPlanError, naming the flags, when the two cannot fit."""
    if utilization is not None and not 0 < utilization <= 1:
        raise MemoryPlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    need = trainer_need(shape, train) if train is not None else None
    held = total - free  # other processes' memory: vLLM refuses to start if it cannot have its share free
    if need is None:
        util = utilization if utilization is not None else VLLM_DEFAULT_UTILIZATION
    else:
        room = total - need.total - OVERHEAD - held
        if utilization is None and room <= 0:
            raise MemoryPlanError(
                f"the in-process trainer alone needs about {_gib(need.total)} (float32 weights {_gib(need.weights)}, "
                f"activations {_gib(need.activations)} at batch {need_batch(train)}) and this GPU has {_gib(total)} "
                f"({_gib(held)} in use): train elsewhere, --redis-url URL --no-trainer here and `skillpool worker "
                "--redis-url URL` on another GPU"
            )
        util = utilization if utilization is not None else room / total
        if total * util + need.total + OVERHEAD + held > total:
            raise MemoryPlanError(
                f"vLLM at --gpu-memory-utilization {util:.2f} ({_gib(total * util)}) and the in-process trainer "
                f"(about {_gib(need.total)}: float32 weights {_gib(need.weights)}, activations "
                f"{_gib(need.activations)} at batch {need_batch(train)}) do not fit this GPU's {_gib(total)} "
                f"({_gib(held)} already in use). Lower --gpu-memory-utilization, or train elsewhere: "
                "--redis-url URL --no-trainer here and `skillpool worker --redis-url URL` on another GPU"
            )
    least = vllm_need(shape, dtype_bytes, max_model_len)
    if total * util < least:
        beside = f" beside the trainer's {_gib(need.total)}" if need is not None else ""
        raise MemoryPlanError(
            f"vLLM needs at least {_gib(least)} (weights and one {max_model_len}-token sequence's KV) but gets "
            f"{_gib(total * util)} (--gpu-memory-utilization {util:.2f} of {_gib(total)}){beside}. Lower "
            "--max-model-len, or train elsewhere: --redis-url URL --no-trainer here and `skillpool worker` on "
            "another GPU"
        )
    if total * util > free:
        raise MemoryPlanError(
            f"--gpu-memory-utilization {util:.2f} asks for {_gib(total * util)} but only {_gib(free)} of "
            f"{_gib(total)} is free: lower it, or free the GPU"
        )
    return VLLMPlan(math.floor(util * 10_000) / 10_000, need)  # rounded down: never past the room
