"""The mix-LoRA operation of `ops.py` as two fused Triton kernels (docs/design/vllm-mix-plugin.md).

`mix_shrink` writes `h[s, t, j] = w[t, j] · A_s[idx[t, j]] x[t]` in fp32 for all K slots of a token in one
program; `mix_expand` sums `B_s[idx[t, j]] h[s, t, j]` over j in fp32 and adds the total to y with one store.
Programs work on "runs" (consecutive tokens with identical idx and w rows, i.e. one request's tokens), so a
prefill run is a block GEMM and a decode token is a masked 16-row block. Triton is imported lazily: this module
imports without it, and `mix_lora_triton` raises a clear ImportError when it is missing.
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import Any

import torch

from .ops import MixOperands

BLOCK_M = 16  # tl.dot needs at least 16 rows; decode runs are masked down to their length
BLOCK_N = 32
BLOCK_K = 32


def mix_runs(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`run_start` [M+1] int32 (run r is tokens run_start[r]..run_start[r+1]) and the longest run's length."""
    t = idx.shape[0]
    if t == 0:
        return torch.zeros(1, dtype=torch.int32, device=idx.device), 0
    change = torch.ones(t, dtype=torch.bool, device=idx.device)
    change[1:] = (idx[1:] != idx[:-1]).any(dim=1) | (w[1:] != w[:-1]).any(dim=1)
    starts = change.nonzero().flatten()
    run_start = torch.cat([starts, torch.tensor([t], device=idx.device)]).to(torch.int32)
    return run_start, int((run_start[1:] - run_start[:-1]).max())


@cache
def _kernels() -> tuple[Any, Any]:
    """Compiles (on first use) the shrink and expand kernels; cached so each is built once per process. A @jit
    kernel takes only tensors and scalars, so each spells out its own pointers, strides and block sizes."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def mix_shrink(
        x_ptr,
        a_ptrs,
        idx_ptr,
        w_ptr,
        run_start_ptr,
        h_ptr,
        IN,
        R,
        stride_xt,
        stride_a_slot,
        stride_a_r,
        stride_idx_t,
        stride_h_s,
        stride_h_t,
        stride_h_k,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        run = tl.program_id(0)
        m_block = tl.program_id(1)
        s = tl.program_id(2)
        start = tl.load(run_start_ptr + run)
        end = tl.load(run_start_ptr + run + 1)
        row0 = start + m_block * BLOCK_M
        if row0 >= end:  # padded grid: this block lies past the run's end
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        a_base = tl.load(a_ptrs + s).to(tl.pointer_type(x_ptr.dtype.element_ty))
        for j in tl.static_range(K):
            slot = tl.load(idx_ptr + start * stride_idx_t + j)
            if slot >= 0:  # -1 pads are never read by the expand, so nothing is written for them
                weight = tl.load(w_ptr + start * stride_idx_t + j)
                acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                a_slot = a_base + slot.to(tl.int64) * stride_a_slot
                for k0 in range(0, IN, BLOCK_K):
                    cols = k0 + offs_k
                    xb = tl.load(
                        x_ptr + rows[:, None].to(tl.int64) * stride_xt + cols[None, :],
                        mask=row_ok[:, None] & (cols[None, :] < IN),
                        other=0.0,
                    )
                    ab = tl.load(
                        a_slot + offs_r[None, :] * stride_a_r + cols[:, None],
                        mask=(offs_r[None, :] < R) & (cols[:, None] < IN),
                        other=0.0,
                    )
                    if UPCAST:  # the interpreter multiplies bf16 bit patterns as integers; fp32 products are exact
                        xb = xb.to(tl.float32)
                        ab = ab.to(tl.float32)
                    acc = tl.dot(xb, ab, acc, input_precision=PRECISION)
                h_rows = h_ptr + s * stride_h_s + rows[:, None].to(tl.int64) * stride_h_t + j * stride_h_k
                tl.store(h_rows + offs_r[None, :], acc * weight, mask=row_ok[:, None] & (offs_r[None, :] < R))

    @triton.jit  # type: ignore[misc]
    def mix_expand(
        h_ptr,
        b_ptrs,
        b_slot_strides,
        out_sizes,
        out_offsets,
        idx_ptr,
        run_start_ptr,
        y_ptr,
        R,
        N_BLOCKS,
        stride_yt,
        stride_b_n,
        stride_idx_t,
        stride_h_s,
        stride_h_t,
        stride_h_k,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        SPLIT_H: tl.constexpr,
        RTNE_BY_HAND: tl.constexpr,
    ):
        run = tl.program_id(0)
        m_block = tl.program_id(1) // N_BLOCKS
        n_block = tl.program_id(1) % N_BLOCKS
        s = tl.program_id(2)
        start = tl.load(run_start_ptr + run)
        end = tl.load(run_start_ptr + run + 1)
        row0 = start + m_block * BLOCK_M
        out_n = tl.load(out_sizes + s)
        if row0 >= end or n_block * BLOCK_N >= out_n:  # padded grid (short run, or a narrower slice)
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < out_n
        offs_r = tl.arange(0, BLOCK_R)
        b_base = tl.load(b_ptrs + s).to(tl.pointer_type(y_ptr.dtype.element_ty))
        b_slot_stride = tl.load(b_slot_strides + s)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        used = 0
        for j in tl.static_range(K):
            slot = tl.load(idx_ptr + start * stride_idx_t + j)
            if slot >= 0:
                used += 1
                hb = tl.load(
                    h_ptr + s * stride_h_s + rows[:, None].to(tl.int64) * stride_h_t + j * stride_h_k + offs_r[None, :],
                    mask=row_ok[:, None] & (offs_r[None, :] < R),
                    other=0.0,
                )
                bb = tl.load(
                    b_base + slot.to(tl.int64) * b_slot_stride + offs_n[None, :] * stride_b_n + offs_r[:, None],
                    mask=n_ok[None, :] & (offs_r[:, None] < R),
                    other=0.0,
                )
                # bf16/fp16 B: h = hi + lo in B's dtype, two tensor-core dots keep ~16 bits of h instead of 8
                h_hi = hb.to(bb.dtype)
                h_lo = (hb - h_hi.to(tl.float32)).to(bb.dtype)
                if UPCAST:
                    bb = bb.to(tl.float32)
                    acc = tl.dot(h_hi.to(tl.float32), bb, acc, input_precision=PRECISION)
                    if SPLIT_H:
                        acc = tl.dot(h_lo.to(tl.float32), bb, acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(h_hi, bb, acc, input_precision=PRECISION)
                    if SPLIT_H:
                        acc = tl.dot(h_lo, bb, acc, input_precision=PRECISION)
        if used > 0:  # a run whose mix is all -1 never touches y, so base rows stay bit-for-bit
            off = tl.load(out_offsets + s)
            y_blk = y_ptr + rows[:, None].to(tl.int64) * stride_yt + off + offs_n[None, :]
            mask = row_ok[:, None] & n_ok[None, :]
            y_old = tl.load(y_blk, mask=mask, other=0.0)
            y_new = y_old.to(tl.float32) + acc
            if RTNE_BY_HAND:  # the interpreter truncates fp32 -> bf16; the GPU rounds to nearest even, as here
                bits = y_new.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                tl.store(y_blk, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
            else:
                tl.store(y_blk, y_new.to(y_ptr.dtype.element_ty), mask=mask)

    return mix_shrink, mix_expand


@lru_cache(maxsize=256)
def _slice_meta(
    a_ptrs: tuple[int, ...], b_ptrs: tuple[int, ...], b_strides: tuple[int, ...], slices: tuple[int, ...], device: str
) -> tuple[torch.Tensor, ...]:
    """Per-slice addresses (vLLM's `_get_lora_a_ptr` trick: one launch covers every slice), B strides, widths and
    column offsets; cached so a steady state makes no host-to-device copies (needed inside a CUDA graph)."""
    offsets = [sum(slices[:s]) for s in range(len(slices))]
    return (
        torch.tensor(a_ptrs, dtype=torch.uint64, device=device),
        torch.tensor(b_ptrs, dtype=torch.uint64, device=device),
        torch.tensor(b_strides, dtype=torch.int64, device=device),
        torch.tensor(slices, dtype=torch.int32, device=device),
        torch.tensor(offsets, dtype=torch.int32, device=device),
    )


def _validate(m: MixOperands) -> None:
    y, x, lora_a, lora_b, output_slices = m.y, m.x, m.lora_a, m.lora_b, m.output_slices
    if not (len(lora_a) == len(lora_b) == len(output_slices)) or not output_slices:
        raise ValueError(f"need one lora_a and lora_b per output slice, got {len(lora_a)}, {len(lora_b)}")
    a0 = lora_a[0]
    for s, (a, b, out) in enumerate(zip(lora_a, lora_b, output_slices, strict=True)):
        if a.shape != a0.shape or a.dim() != 4 or a.shape[3] != x.shape[1]:
            raise ValueError(f"lora_a[{s}] is {tuple(a.shape)}, expected {tuple(a0.shape)} with in = {x.shape[1]}")
        if b.dim() != 4 or b.shape[0] != a0.shape[0] or b.shape[2] != out or b.shape[3] != a0.shape[2]:
            raise ValueError(f"lora_b[{s}] is {tuple(b.shape)}, expected [{a0.shape[0]}, 1, {out}, {a0.shape[2]}]")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("lora_a and lora_b must be contiguous (one set of strides serves every slice)")
        if a.dtype != x.dtype or b.dtype != y.dtype:
            raise ValueError(f"dtypes disagree: x {x.dtype}, lora_a {a.dtype}, y {y.dtype}, lora_b {b.dtype}")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x and y need unit stride along their last dimension")


def mix_lora_triton(m: MixOperands, runs: tuple[torch.Tensor, int] | None = None) -> None:
    """Same contract as `mix_lora_torch`. `runs` (from `mix_runs`, may be padded) fixes the grid for CUDA graphs;
    a caller that passes it vouches that idx is in range, since the check costs a host sync."""
    _validate(m)
    try:
        shrink, expand = _kernels()
    except ImportError as e:
        raise ImportError("mix_lora_triton needs triton (the vLLM venv has it; use mix_lora_torch on CPU)") from e
    import triton

    y, x, lora_a, lora_b, output_slices = m.y, m.x, m.lora_a, m.lora_b, m.output_slices
    t, k = m.idx.shape
    if t == 0 or k == 0:
        return
    idx = m.idx.to(torch.int32).contiguous()
    w = m.w.to(torch.float32).contiguous()
    _, _, rank, in_dim = lora_a[0].shape
    if runs is None:
        bad = int(((idx < -1) | (idx >= lora_a[0].shape[0])).sum())  # an out-of-range slot would read stray memory
        if bad:
            raise ValueError(f"{bad} idx entries are outside -1..{lora_a[0].shape[0] - 1}")
        runs = mix_runs(idx, w)
    run_start, max_len = runs
    if max_len == 0:
        return
    n_runs, n_slices = run_start.numel() - 1, len(output_slices)
    a_ptrs, b_ptrs, b_strides, widths, offsets = _slice_meta(
        tuple(a.data_ptr() for a in lora_a), tuple(b.data_ptr() for b in lora_b),
        tuple(b.stride(0) for b in lora_b), tuple(output_slices), str(x.device),
    )  # fmt: skip
    block_r = max(16, triton.next_power_of_2(rank))  # tl.dot needs 16 on every side; pad rows are masked
    upcast = bool(triton.knobs.runtime.interpret)  # Triton 3.9's interpreter gets bf16/fp16 tl.dot wrong
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"  # fp32 must not drop to tf32 (1e-5 bar)
    h = torch.empty((n_slices, t, k, rank), dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(max_len, BLOCK_M)
    shrink[(n_runs, m_blocks, n_slices)](
        x, a_ptrs, idx, w, run_start, h,
        in_dim, rank, x.stride(0), lora_a[0].stride(0), lora_a[0].stride(2), idx.stride(0),
        h.stride(0), h.stride(1), h.stride(2),
        K=k, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=precision, UPCAST=upcast,
    )  # fmt: skip
    n_blocks = triton.cdiv(max(output_slices), BLOCK_N)
    b_precision = "ieee" if upcast or y.dtype == torch.float32 else "tf32"
    expand[(n_runs, m_blocks * n_blocks, n_slices)](
        h, b_ptrs, b_strides, widths, offsets, idx, run_start, y,
        rank, n_blocks, y.stride(0), lora_b[0].stride(2), idx.stride(0), h.stride(0), h.stride(1), h.stride(2),
        K=k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, PRECISION=b_precision, UPCAST=upcast,
        SPLIT_H=y.dtype != torch.float32, RTNE_BY_HAND=upcast and y.dtype == torch.bfloat16,
    )  # fmt: skip
