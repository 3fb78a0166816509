"""The dtype the base model computes in: one choice (`--dtype auto|float32|bfloat16`) for the engine, the trainer
and the worker.

`auto` is bfloat16 on a CPU whose flags say it multiplies bf16 in hardware (AVX-512 BF16 or AMX), float32 on
other CPUs (there bf16 is emulated and slower than fp32), and each part's own default on CUDA (the engine bf16,
the trainer fp32). SKILLPOOL_DTYPE gives the choice where none is passed.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a dtype is resolved: the configs that name one stay light to import
    import torch

DTYPES = ("auto", "float32", "bfloat16")
DTYPE_SETTING = "SKILLPOOL_DTYPE"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

log = logging.getLogger(__name__)


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware: its /proc/cpuinfo flags, read once; where there is no
    such file, torch's own probe of the CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import torch

        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(BF16_FLAGS & set(line.partition(":")[2].split()))
    return False


def check_dtype(choice: str) -> str:
    """`choice` if it names a dtype setting; otherwise a ValueError naming the choices."""
    if choice not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {choice!r}")
    return choice


def dtype_choice(choice: str | None = None) -> str:
    """The setting in force: `choice`, else SKILLPOOL_DTYPE, else auto."""
    return check_dtype(choice or os.environ.get(DTYPE_SETTING) or "auto")


def resolve_dtype(choice: str | None, device: str, cuda: str = "bfloat16") -> torch.dtype:
    """The torch dtype for `choice` (None: dtype_choice's) on `device`; `cuda` is what auto means on a GPU."""
    import torch

    choice = dtype_choice(choice)
    if device.partition(":")[0] == "cpu" and not cpu_has_bf16():
        _say_no_bf16(choice)
    if choice == "auto":
        choice = cuda if device.startswith("cuda") else "bfloat16" if cpu_has_bf16() else "float32"
    return torch.bfloat16 if choice == "bfloat16" else torch.float32


@functools.cache  # once a process for each choice: the engine, the trainer and each training run resolve one
def _say_no_bf16(choice: str) -> None:
    if choice == "bfloat16":
        log.warning(
            "--dtype bfloat16 on a CPU without AVX-512 BF16 or AMX: its bf16 products are emulated and run slower "
            "than float32 (docs/serving.md, The dtype); --dtype auto computes in float32 here"
        )
    elif choice == "auto":
        log.warning(
            "this CPU has no AVX-512 BF16 or AMX: --dtype auto computes in float32 (bfloat16 would be emulated)"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """float32 / bfloat16 (what meta.json and the logs say)."""
    return str(dtype).removeprefix("torch.")
