"""The fused Triton mix kernels (and the CPU union GEMM) against the float64 token-by-token reference: ranks
8/16/64 zero-padded in one stack, k = 1…4, empty-mix rows left bit-for-bit, decode runs of 1 and prefill runs
of 37, 1 and 3 output slices, fp32 and bf16, and bitwise-equal reruns. Without a GPU the kernels run under
Triton's interpreter (TRITON_INTERPRET=1). Run: pytest -m vllm --slow."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace

import pytest
import torch

from skillpool.server.engines.vllm_mix.ops import MixOperands, mix_lora_reference, mix_lora_torch

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (it comes with the vLLM venv: bash setup.sh --engine vllm)", allow_module_level=True
    )
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first built, so this precedes any launch

from skillpool.server.engines.vllm_mix.triton_mix import mix_lora_triton, mix_runs  # noqa: E402

IN = 80  # not a multiple of the kernel's BLOCK_K, so the masked tail is exercised
RANKS = (8, 16, 64, 8, 16, 64)  # real ranks of the stack's slots, all zero-padded to 64
SLICES = {1: (96,), 3: (96, 48, 32)}  # QKV-like: three slices of different widths


@dataclass
class Batch:
    x: torch.Tensor
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    idx: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    empty: torch.Tensor  # rows whose whole mix is -1
    slices: tuple[int, ...]

    def operands(self, y: torch.Tensor, device: str = "cpu") -> MixOperands:
        """The batch's operands on `device`, adding into `y`."""
        a, b = [t.to(device) for t in self.a], [t.to(device) for t in self.b]
        return MixOperands(y, self.x.to(device), a, b, self.idx.to(device), self.w.to(device), self.slices)


def make_batch(k: int, n_slices: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    """A prefill run of 37, an empty prefill of 5, decode rows (own mixes, a shared one, an empty one, -1 pads
    and a repeated slot), then a prefill of 19 starting off a 16-row boundary."""
    g = torch.Generator().manual_seed(seed)
    slices, stack_r, n = SLICES[n_slices], max(RANKS), len(RANKS)
    a, b = [], []
    for out in slices:
        ai = torch.randn(n, 1, stack_r, IN, generator=g) / IN**0.5
        bi = torch.randn(n, 1, out, stack_r, generator=g) / 4
        for slot, r in enumerate(RANKS):
            ai[slot, :, r:] = 0
            bi[slot, :, :, r:] = 0
        a.append(ai.to(dtype))
        b.append(bi.to(dtype))

    def mix() -> list[int]:
        return torch.randperm(n, generator=g)[:k].tolist()

    rows: list[list[int]] = [mix()] * 37 + [[-1] * k] * 5
    decode = [mix() for _ in range(6)]
    decode[2] = [-1] * k
    if k > 1:
        decode[3] = decode[3][:1] + [-1] * (k - 1)
        decode[4] = [decode[4][0]] * k
    rows += decode + [decode[-1]] + [mix()] * 19
    idx = torch.tensor(rows, dtype=torch.int32)
    w = torch.rand(idx.shape, generator=g) + 0.1
    for start in range(1, len(rows)):
        if rows[start] == rows[start - 1]:
            w[start] = w[start - 1]  # a run shares its weights too
    w[idx < 0] = 0
    t = len(rows)
    x = torch.randn(t, IN, generator=g).to(dtype)
    y = torch.randn(t, sum(slices), generator=g).to(dtype)
    empty = (idx < 0).all(dim=1)
    y[empty.nonzero()[0, 0], 0] = -0.0  # a signed zero an exact "+0" add would flip
    return Batch(x, a, b, idx, w, y, empty, slices)


def reference(batch: Batch) -> torch.Tensor:
    """fp32 inputs upcast, the sum in float64, one rounding to fp32."""
    ref = batch.y.to(torch.float32, copy=True)
    a32 = [a.to(torch.float32) for a in batch.a]
    b32 = [b.to(torch.float32) for b in batch.b]
    mix_lora_reference(MixOperands(ref, batch.x.to(torch.float32), a32, b32, batch.idx, batch.w, batch.slices))
    return ref


def run_triton(batch: Batch) -> torch.Tensor:
    y = batch.y.to(DEVICE, copy=True)
    mix_lora_triton(batch.operands(y, DEVICE))
    return y.cpu()


def check(out: torch.Tensor, ref: torch.Tensor, batch: Batch, rtol: float, atol_rel: float) -> None:
    assert torch.equal(out[batch.empty].view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32),
                       batch.y[batch.empty].view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    assert not torch.equal(ref[~batch.empty], batch.y[~batch.empty].to(torch.float32))  # the mix did something
    torch.testing.assert_close(out.to(torch.float32), ref, rtol=rtol, atol=atol_rel * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_slices", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_triton_matches_reference(k: int, n_slices: int, dtype: torch.dtype) -> None:
    batch = make_batch(k, n_slices, dtype, seed=k * 10 + n_slices)
    out = run_triton(batch)
    if dtype == torch.float32:
        check(out, reference(batch), batch, rtol=1e-5, atol_rel=1e-5)
    else:  # y is the exact sum rounded once to bf16 (unit roundoff 2^-8), so the bar is per element, not max|ref|
        check(out, reference(batch), batch, rtol=2**-8, atol_rel=1e-4)
    assert torch.equal(run_triton(batch).view(torch.uint8), out.view(torch.uint8))  # a rerun is bitwise equal


@pytest.mark.parametrize("n_slices", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_torch_path_matches_reference(k: int, n_slices: int) -> None:
    batch = make_batch(k, n_slices, torch.float32, seed=k * 10 + n_slices)
    batch.y[batch.empty] = batch.y[batch.empty].abs()  # the union GEMM adds an exact +0, which turns -0.0 into +0.0
    out = batch.y.clone()
    mix_lora_torch(batch.operands(out))
    check(out, reference(batch), batch, rtol=1e-5, atol_rel=1e-5)
    again = batch.y.clone()
    mix_lora_torch(batch.operands(again))
    assert torch.equal(again.view(torch.int32), out.view(torch.int32))


def test_runs_group_contiguous_equal_rows() -> None:
    batch = make_batch(3, 1, torch.float32)
    run_start, longest = mix_runs(batch.idx, batch.w)
    # 37 prefill, 5 empty, decode rows 0-4 alone, decode row 5 with its repeat, then the 19-token prefill
    assert run_start.tolist() == [0, 37, 42, 43, 44, 45, 46, 47, 49, 68]
    assert longest == 37


def test_bad_shapes_are_refused() -> None:
    batch = make_batch(2, 3, torch.float32)
    operands = batch.operands(batch.y)
    with pytest.raises(ValueError, match="mix shapes disagree"):
        replace(operands, idx=batch.idx[1:])
    with pytest.raises(ValueError, match="columns"):
        replace(operands, output_slices=batch.slices[1:])
    with pytest.raises(ValueError, match="lora_b"):
        mix_lora_triton(replace(operands, lora_b=batch.b[::-1]))
    with pytest.raises(ValueError, match="dtypes"):
        mix_lora_triton(replace(operands, y=batch.y.to(torch.bfloat16)))
    for slot in (len(RANKS), -2):
        idx = batch.idx.clone()
        idx[0, 0] = slot
        with pytest.raises(ValueError, match="outside -1..5"):
            mix_lora_triton(replace(operands, idx=idx))


def test_padded_runs_give_the_same_bits() -> None:
    """A CUDA-graph caller passes a fixed-size run table (trailing empty runs) and a worst-case run length."""
    batch = make_batch(2, 3, torch.float32, seed=5)
    out = run_triton(batch)
    run_start, _ = mix_runs(batch.idx, batch.w)
    t = batch.idx.shape[0]
    padded = torch.cat([run_start, torch.full((6,), t, dtype=torch.int32)])
    y = batch.y.clone()
    mix_lora_triton(batch.operands(y), runs=(padded, t))
    assert torch.equal(y.view(torch.int32), out.view(torch.int32))
