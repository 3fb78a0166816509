"""vLLM's CPU punica wrapper plus per-token mixes: with a mix set, every LoRA linear layer adds
`Σ_j w[t,j] · B_idx (A_idx x)` (ops.mix_lora_torch); without one it is vLLM's wrapper unchanged."""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from .ops import MixOperands, Slices, Stack, mix_lora_torch, vllm_add_lora_linear


class MixPunicaWrapperCPU(PunicaWrapperCPU):  # type: ignore[misc]
    _mix: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_mix(self, idx: torch.Tensor | None, w: torch.Tensor | None = None) -> None:
        """The step's [T, K] slots and weights, or None for vLLM's own single-LoRA path."""
        if idx is None or w is None:
            self._mix = None
            return
        self._mix = (idx.to(self.device), w.to(device=self.device, dtype=torch.float32))

    add_lora_linear = vllm_add_lora_linear

    def mix_linear(
        self, y: torch.Tensor, x: torch.Tensor, a: Stack, b: Stack, scale: float, slices: Slices, **kwargs: Any
    ) -> None:
        if self._mix is None:
            super().add_lora_linear(y, x, a, b, scale, slices, **kwargs)
            return
        idx, w = self._mix
        t = x.shape[0]
        if idx.shape[0] < t:  # padded tokens beyond the scheduled ones get no LoRA
            pad = t - idx.shape[0]
            idx = torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)])
            w = torch.cat([w, w.new_zeros((pad, w.shape[1]))])
        mix_lora_torch(MixOperands(y, x, a, b, idx[:t], w[:t] * scale, slices))
