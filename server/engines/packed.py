"""A bfloat16 model's Linears with their weights also in oneDNN's blocked layout, on a CPU.

`F.linear` in bfloat16 re-lays its weight out for oneDNN on every call; a decode step is ~200 small products,
so keeping each weight packed once (what torch.compile's freezing does for inference) cuts a step's matmul
time by about a quarter (load_tests/serving/bench_engine_step.py). The packed product is the same oneDNN kernel:
its results are checked against `F.linear` once, and a model whose check fails is left as it was. The packed
copy is kept beside the weight (LoRA shapes, the tied embedding and transformers still read `.weight`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from torch.nn import functional as F

log = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward multiplies by `packed`, its weight in oneDNN's layout (set by `pack_linears`)."""

    packed: Tensor

    def forward(self, input: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)  # tuned for decode batches of ~16 rows


def pack_linears(model: nn.Module) -> int:
    """Turn every bfloat16 CPU Linear of `model` into a PackedLinear (in place); how many. None when this torch
    has no oneDNN bfloat16 linear, or its packed product differs from F.linear's."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16]
    if not linears or not torch.backends.mkldnn.is_available() or linears[0].weight.device.type != "cpu":
        return 0
    probe = linears[0]
    x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._linear_pointwise(x, _pack(probe.weight), probe.bias, "none", [], "")
            ok = torch.allclose(packed.float(), F.linear(x, probe.weight, probe.bias).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError) as e:  # a torch without these oneDNN ops
        log.info("bfloat16 Linears stay unpacked: %s", e)
        return 0
    if not ok:
        log.warning("bfloat16 Linears stay unpacked: oneDNN's packed product differs from F.linear here")
        return 0
    with torch.inference_mode():
        for m in linears:
            m.__class__ = PackedLinear  # the same module, its forward the packed product
            m.packed = _pack(m.weight)
    return len(linears)
