"""vLLM's CUDA punica wrapper plus per-token mixes, as one opaque custom op (off unless SKILLPOOL_VLLM_MIX_CUDA=1:
its one GPU run served mixes exactly but slowly, docs/benchmarks.md#on-a-gpu).

vLLM compiles the forward with dynamo guards off and captures it in CUDA graphs, so a Python branch in
`add_lora_linear` would be frozen at compile time (docs/design/vllm-mix-plugin.md, "The math on each backend").
Hence every LoRA linear layer calls `torch.ops.vllm.skillpool_mix_lora` unconditionally. Its inputs are persistent
buffers, allocated once at [max_num_batched_tokens, max_loras] and rewritten in place each step:
- `idx`/`w`: each token's (slot, weight) pairs; with no mix set they hold vLLM's own mapping (pass 0 = the
  token's adapter with weight 1, other passes −1), so dummy, profile and capture runs compute what vLLM would;
- `run_start`: the runs (consecutive tokens with one mix) that fix the Triton grid, padded with empty runs.
The op slices them to the forward's T, so tokens past the scheduled ones (CUDA-graph padding) lie in no run and
are never touched. Only the host builds tables (in `set_mix`, before the forward): the op never syncs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
from vllm.utils.torch_utils import direct_register_custom_op

from .ops import MixOperands, Slices, Stack, vllm_add_lora_linear

OP_NAME = "skillpool_mix_lora"
_LONGEST_RUN: dict[int, int] = {}  # run_start buffer address -> this step's longest run (host), for eager grids


def mix_lora_op(  # torch infers the op's schema from these flat, annotated parameters: no MixOperands here
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    idx: torch.Tensor,
    w: torch.Tensor,
    run_start: torch.Tensor,
    output_slices: list[int],
    scale: float,
) -> None:
    """`y[:T] += Σ_j w·B(Ax)` over the runs in `run_start`, with T = x's rows and idx/w the full persistent
    buffers. While a CUDA graph is captured the grid covers T rows per run (replays may bring other runs);
    eagerly it covers the longest run `set_mix` saw, so a decode step launches no idle blocks."""
    from .triton_mix import mix_lora_triton  # triton only loads when the op first runs

    t = x.size(0)
    if t == 0:
        return
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    longest = t if capturing else min(t, _LONGEST_RUN.get(run_start.data_ptr(), t))
    weights = w[:t] if scale == 1.0 else w[:t] * scale
    mix_lora_triton(MixOperands(y, x, lora_a, lora_b, idx[:t], weights, output_slices), runs=(run_start, longest))


def _mix_lora_fake(*args: Any) -> None:
    """The op only adds into y in place, so tracing needs no shapes from it (and none of its arguments)."""


def _register_op() -> None:
    if not hasattr(torch.ops.vllm, OP_NAME):  # importing twice (tests, spawned workers) must not re-register
        direct_register_custom_op(OP_NAME, mix_lora_op, mutates_args=["y"], fake_impl=_mix_lora_fake)


_register_op()


def run_starts(idx: np.ndarray, w: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """`size` run boundaries (int32; run r is tokens [r_start[r], r_start[r+1])), padded with empty runs at T,
    and the longest run's length. A run is a stretch of tokens with identical idx and w rows."""
    t = idx.shape[0]
    if t == 0:
        return np.zeros(size, dtype=np.int32), 0
    change = np.ones(t, dtype=bool)
    change[1:] = (idx[1:] != idx[:-1]).any(axis=1) | (w[1:] != w[:-1]).any(axis=1)
    starts = np.flatnonzero(change)
    if starts.size + 1 > size:
        raise ValueError(f"{starts.size} runs exceed the {size - 1} the wrapper's grid was sized for (max_batches)")
    bounds = np.full(size, t, dtype=np.int32)
    bounds[: starts.size] = starts
    longest = int(np.diff(np.append(starts, t)).max())
    return bounds, longest


class MixPunicaWrapperGPU(PunicaWrapperGPU):  # type: ignore[misc]
    """`set_mix(idx, w)` before the forward; `add_lora_linear` always runs the mix op (see the module doc)."""

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs: Any):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self.mix_k = int(self.max_loras)  # a mix has at most one pair per resident slot
        self.max_tokens = int(max_num_batched_tokens)
        self._idx = torch.full((self.max_tokens, self.mix_k), -1, dtype=torch.int32, device=device)
        self._w = torch.zeros((self.max_tokens, self.mix_k), dtype=torch.float32, device=device)
        self._run_start = torch.full((int(max_batches) + 2,), 0, dtype=torch.int32, device=device)
        _LONGEST_RUN[self._run_start.data_ptr()] = 0
        self._default = (np.zeros((0, 1), dtype=np.int32), np.zeros((0, 1), dtype=np.float32))

    def update_metadata(
        self, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int, **kwargs: Any
    ) -> None:
        """vLLM's metadata (its logits/embedding paths keep using it) and, from the same host mapping, the
        default tables `set_mix(None)` installs: each token's adapter at weight 1, base tokens −1."""
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        slot_of = {lid: s for s, lid in enumerate(lora_index_to_id) if lid is not None}
        ids = np.asarray(mapping.index_mapping, dtype=np.int64)
        slots = np.array([slot_of.get(int(i), -1) if i > 0 else -1 for i in ids], dtype=np.int32).reshape(-1, 1)
        self._default = (slots, (slots >= 0).astype(np.float32))
        self.set_mix(None)

    def set_mix(self, idx: torch.Tensor | np.ndarray | None, w: torch.Tensor | np.ndarray | None = None) -> None:
        """The step's [T, K'] slots and weights (K' ≤ max_loras), or None for the default tables. Copies into
        the persistent buffers; called outside the forward, so host work here costs no GPU sync."""
        if idx is None or w is None:
            idx_h, w_h = self._default
        else:
            idx_h = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
            w_h = w.cpu().numpy() if isinstance(w, torch.Tensor) else np.asarray(w)
        t, k = idx_h.shape
        if w_h.shape != (t, k) or t > self.max_tokens or k > self.mix_k:
            raise ValueError(
                f"mix tables {idx_h.shape}/{w_h.shape} do not fit [≤{self.max_tokens}, ≤{self.mix_k}] buffers"
            )
        if t and (int(idx_h.min()) < -1 or int(idx_h.max()) >= self.mix_k):
            raise ValueError(f"mix slots must be -1..{self.mix_k - 1}")  # the kernel trusts them: no device check
        full_idx = np.full((t, self.mix_k), -1, dtype=np.int32)
        full_w = np.zeros((t, self.mix_k), dtype=np.float32)
        full_idx[:, :k] = idx_h
        full_w[:, :k] = w_h
        bounds, longest = run_starts(full_idx, full_w, self._run_start.numel())
        self._idx[:t].copy_(torch.from_numpy(full_idx))
        self._w[:t].copy_(torch.from_numpy(full_w))
        self._run_start.copy_(torch.from_numpy(bounds))
        _LONGEST_RUN[self._run_start.data_ptr()] = longest

    add_lora_linear = vllm_add_lora_linear

    def mix_linear(
        self, y: torch.Tensor, x: torch.Tensor, a: Stack, b: Stack, scale: float, slices: Slices, **kwargs: Any
    ) -> None:
        if kwargs.get("buffer") is not None:
            raise ValueError("the mix op makes its own buffer (as vLLM's GPU wrapper asserts)")
        if not kwargs.get("add_inputs", True):
            raise ValueError("the mix op always adds into y (add_inputs=False is not a linear-layer call)")
        torch.ops.vllm.skillpool_mix_lora(
            y, x, list(a), list(b), self._idx, self._w, self._run_start, list(slices), float(scale)
        )
