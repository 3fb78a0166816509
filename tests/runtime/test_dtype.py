"""What `--dtype` resolves to, and what a CPU without bf16 arithmetic is told: the CPU's flags are the one input
from the machine, so each case sets them and the results do not depend on where the tests run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from skillpool.runtime import dtype as dtype_module
from skillpool.runtime.dtype import resolve_dtype


@pytest.fixture
def cpu_bf16(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Set `[0]` to say whether the CPU has bf16 arithmetic; each test starts with nothing said yet."""
    has = [False]
    monkeypatch.setattr(dtype_module, "cpu_has_bf16", lambda: has[0])
    monkeypatch.delenv(dtype_module.DTYPE_SETTING, raising=False)
    dtype_module._say_no_bf16.cache_clear()
    yield has
    dtype_module._say_no_bf16.cache_clear()


def test_auto_is_bfloat16_only_where_the_cpu_multiplies_it_in_hardware(cpu_bf16: list[bool]) -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    cpu_bf16[0] = True
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", cuda="float32") == torch.float32
    assert resolve_dtype("float32", "cpu") == torch.float32


def test_a_cpu_without_bf16_is_named_once_and_a_forced_bfloat16_is_warned_of(
    cpu_bf16: list[bool], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger=dtype_module.__name__):
        for _ in range(3):  # the engine, the trainer and a training run each resolve it: one line
            assert resolve_dtype("auto", "cpu") == torch.float32
        assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # as asked, with a warning
        resolve_dtype("bfloat16", "cpu")
        resolve_dtype("float32", "cpu")  # float32 is never emulated: nothing to say
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "auto computes in float32" in said[0]
    assert "--dtype bfloat16" in said[1] and "emulated" in said[1]


def test_a_cpu_with_bf16_or_a_gpu_hears_nothing(cpu_bf16: list[bool], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger=dtype_module.__name__):
        resolve_dtype("bfloat16", "cuda")  # the GPU's arithmetic, not the CPU's flags
        cpu_bf16[0] = True
        resolve_dtype("auto", "cpu")
        resolve_dtype("bfloat16", "cpu")
    assert caplog.records == []


def test_an_unknown_dtype_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        resolve_dtype("float16", "cpu")
