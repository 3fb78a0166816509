"""A mix written as one concatenated LoRA (for vLLM) must carry exactly the mix's delta, through plain PEFT too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skillpool.adapters_store.concat import concat_mix, write_concat, zero_adapter
from skillpool.adapters_store.lora import (
    PEFT_CONFIG,
    LoRAAdapter,
    LoRAFactors,
    load_peft_adapter,
    mix_delta,
    save_peft_adapter,
)
from skillpool.adapters_store.lora_bank import LoRABank

from .test_lora import TARGETS, random_adapter, tiny_llama


def three_skills() -> tuple[torch.nn.Module, list[tuple[LoRAAdapter, float]]]:
    model = tiny_llama()
    a = random_adapter(model, rank=4, alpha=8, seed=1)
    b = random_adapter(model, rank=2, alpha=16, seed=2, targets=("q_proj", "v_proj"))  # fewer modules
    c = random_adapter(model, rank=8, alpha=4, seed=3)
    return model, [(a, 0.5), (b, 0.3125), (c, 0.1875)]


def test_concatenated_adapter_equals_dense_weighted_sum() -> None:
    _, mix = three_skills()
    cat = concat_mix(mix)
    for path, f in cat.modules.items():
        assert f.rank == 4 + 2 + 8 and f.scaling == 1.0
        dense = mix_delta([(a.modules[path], w) for a, w in mix if path in a.modules])
        torch.testing.assert_close(f.delta(), dense, rtol=1e-5, atol=1e-6)
    assert set(cat.modules) == {p for a, _ in mix for p in a.modules}


def test_folder_reloads_with_plain_peft_and_matches_our_mix_layer(tmp_path: Path) -> None:
    from peft import PeftModel

    model, mix = three_skills()
    write_concat(concat_mix(mix), tmp_path / "mix", "tiny")
    cfg = json.loads((tmp_path / "mix" / PEFT_CONFIG).read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 14 and cfg["use_rslora"] is False
    x = torch.randint(0, 97, (2, 9))

    bank = LoRABank(model)  # our own per-row mix layer, on the original three skills
    for i, (a, _) in enumerate(mix):
        bank.add(f"s{i}", a)
    with torch.no_grad(), bank.mixed([[(f"s{i}", w) for i, (_, w) in enumerate(mix)]] * 2):
        ours = model(x).logits
    bank.deactivate()
    with torch.no_grad():
        base = model(x).logits

    # PEFT on a fresh copy of the same base weights
    fresh = tiny_llama()
    peft = PeftModel.from_pretrained(fresh, str(tmp_path / "mix")).eval()
    with torch.no_grad():
        theirs = peft(x).logits
    assert (ours - base).abs().max() > 1e-2  # the mix changes the output, so the comparison means something
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_rslora_source_still_gives_the_exact_delta(tmp_path: Path) -> None:
    """PEFT's add_weighted_adapter("cat") copies use_rslora from the first adapter and rescales; we must not."""
    model = tiny_llama()
    src = random_adapter(model, rank=4, alpha=8, seed=5)
    save_peft_adapter(src, tmp_path / "plain", "tiny", alpha=8, target_modules=TARGETS)
    cfg_path = tmp_path / "plain" / PEFT_CONFIG
    cfg = json.loads(cfg_path.read_text())
    cfg["use_rslora"] = True  # the same tensors, now scaled alpha / sqrt(r) = 4 instead of alpha / r = 2
    cfg_path.write_text(json.dumps(cfg))
    rs = load_peft_adapter(tmp_path / "plain")
    other = random_adapter(model, rank=2, alpha=2, seed=6)
    mix = [(rs, 0.75), (other, 0.25)]
    write_concat(concat_mix(mix), tmp_path / "mix", "tiny")
    back = load_peft_adapter(tmp_path / "mix")
    written = json.loads((tmp_path / "mix" / PEFT_CONFIG).read_text())
    assert written["use_rslora"] is False and written["r"] == written["lora_alpha"] == 6
    for path, f in back.modules.items():
        assert f.scaling == 1.0
        want = 0.75 * 4.0 * (src.modules[path].B @ src.modules[path].A) + 0.25 * other.modules[path].delta()
        torch.testing.assert_close(f.delta(), want, rtol=1e-5, atol=1e-6)


def test_zero_adapter_has_zero_delta_and_bad_input_is_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    z = zero_adapter(random_adapter(model, rank=2, alpha=2, seed=7))
    write_concat(z, tmp_path / "zero", "tiny")
    for f in load_peft_adapter(tmp_path / "zero").modules.values():
        assert f.rank == 1 and not f.delta().any()
    with pytest.raises(ValueError):
        concat_mix([])
    a = LoRAAdapter({"m": LoRAFactors(torch.ones(1, 3), torch.ones(2, 1), 1.0)})
    b = LoRAAdapter({"m": LoRAFactors(torch.ones(1, 4), torch.ones(2, 1), 1.0)})
    with pytest.raises(ValueError, match="disagree"):
        concat_mix([(a, 0.5), (b, 0.5)])


def test_a_write_that_fills_the_disk_leaves_no_folder_and_keeps_a_whole_one(tmp_path: Path) -> None:
    from tests.disk import fill, small_tmpfs, temp_leftovers

    model = tiny_llama()
    cat = concat_mix([(random_adapter(model, rank=4, alpha=8, seed=1), 1.0)])
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        write_concat(cat, disk / "kept", "tiny")  # a whole folder, then rewritten in place (the zero adapter is)
        write_concat(concat_mix([(random_adapter(model, rank=2, alpha=2, seed=2), 1.0)]), disk / "kept", "tiny")
        kept = load_peft_adapter(disk / "kept")
        assert {f.rank for f in kept.modules.values()} == {2}
        ballast = fill(disk)
        with pytest.raises(OSError):
            write_concat(cat, disk / "new", "tiny")
        with pytest.raises(OSError):
            write_concat(cat, disk / "kept", "tiny")
        assert not (disk / "new").exists() and temp_leftovers(disk) == []  # nothing half-written to load later
        again = load_peft_adapter(disk / "kept")  # the earlier folder is untouched
        assert all(torch.equal(again.modules[p].B, f.B) for p, f in kept.modules.items())
        ballast.unlink()
        write_concat(cat, disk / "new", "tiny")  # with room again, the same write succeeds
        assert {f.rank for f in load_peft_adapter(disk / "new").modules.values()} == {4}
