"""SAPT attentive learning on the tiny LLaMA: the training mix is the serving mix, training leaves the
model, the frozen block and the input state as they were, and the new block and key take over the new task."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from skillpool.lora.adapter import LoRAAdapter, load_peft_adapter, save_peft_adapter
from skillpool.lora.bank import LoRABank
from skillpool.lora.mixed_layer import MixedLoRALinear
from skillpool.lora.training_mix import weighted_mix
from skillpool.router.sapt import SAPTSettings, SAPTState, TokenPooler
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.loop import Cancelled, Progress, answer_loss, checkpointing_active, collate
from skillpool.trainer.lora_train import encode_example, pad_id
from skillpool.trainer.methods.sapt import new_block, train_attentive
from tests.lora.test_adapter import tiny_llama

# the tiny random LLaMA learns slowly (near-uniform logits, embeddings of std 0.02): large rates, few steps
CFG = TrainConfig(
    rank=4,
    alpha=8.0,
    dropout=0.0,
    target_modules=["q_proj", "v_proj"],
    epochs=12,
    batch_size=4,
    learning_rate=5e-2,
    warmup_ratio=0.0,
    max_seq_len=48,
    seed=0,
)
SETTINGS = SAPTSettings(hidden=16, lr=5e-2, seed=0)
WORDS = ["apple", "river", "stone", "cloud", "tiger", "paper", "glass", "honey", "mouse", "piano", "chair", "lemon"]


def task(prompt: str, answer: str) -> list[dict[str, Any]]:
    out = []
    for w in WORDS:
        text = prompt.format(w)
        out.append({"messages": [{"role": "user", "content": text}], "answer": answer.format(w), "route_text": text})
    return out


OLD = task("Translate into French the word {}", "le mot {}")
NEW = task("How many vowels are in {}? Count them.", "There are some vowels.")


def rows_mixed_loss(
    model: Any, tok: Any, blocks: list[LoRAAdapter], weights: torch.Tensor, examples: list[dict[str, Any]]
) -> float:
    """Answer loss of the model with `blocks` mixed by per-row `weights` (the served model for that routing)."""
    batch = collate([encode_example(tok, ex, CFG.max_seq_len) for ex in examples], pad_id(tok))
    shim = type("Shim", (), {"get_base_model": lambda self: model})()
    with torch.no_grad(), weighted_mix(model, blocks) as mix:
        mix.set_weights(weights)
        return float(answer_loss(shim, batch))


@pytest.fixture(scope="module")
def trained(tiny_base):  # type: ignore[no-untyped-def]
    """An old skill learned from an empty state (the single-block path), then the new one on top of it."""
    tok = AutoTokenizer.from_pretrained(str(tiny_base.path))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base.path)).eval()
    pooler = TokenPooler(model.get_input_embeddings().weight, tok)
    empty = SAPTState(pooler.dim, SETTINGS)
    first = train_attentive(model, tok, "old", OLD[:8], [e["route_text"] for e in OLD[8:]], CFG, empty, pooler, {}, {})
    state, old = first.state, first.adapter
    before = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "old": {p: (f.A.clone(), f.B.clone()) for p, f in old.modules.items()},
        "keys": state.keys.clone(),
        "names": list(state.names),
        "attention": copy.deepcopy(state.mean_attention),
        "projector": {k: v.clone() for k, v in state.projector.state_dict().items()},
    }
    progress: list[Progress] = []
    result = train_attentive(
        model,
        tok,
        "new",
        NEW[:8],
        [e["route_text"] for e in NEW[8:]],
        CFG,
        state,
        pooler,
        {"old": old},
        {"old": [e["route_text"] for e in OLD[:3]]},
        on_progress=progress.append,
    )
    return {
        "model": model,
        "tok": tok,
        "pooler": pooler,
        "state": state,
        "old": old,
        "result": result,
        "before": before,
        "progress": progress,
    }


def test_new_block_is_peft_like_and_leaves_the_global_rng_alone() -> None:
    model = tiny_llama()
    rng = torch.random.get_rng_state()
    one, two = new_block(model, CFG), new_block(model, CFG)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert set(one.modules) == {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")}
    for path, f in one.modules.items():
        assert torch.equal(f.A, two.modules[path].A) and f.A.abs().sum() > 0  # seeded, not zero
        assert not f.B.any() and f.scaling == CFG.alpha / CFG.rank and f.A.requires_grad


def test_training_inside_the_mix(trained) -> None:  # type: ignore[no-untyped-def]
    model, tok, pooler, state, old, result = (trained[k] for k in ("model", "tok", "pooler", "state", "old", "result"))
    before = trained["before"]
    # the caller's model, frozen block and state are as they were
    assert not any(isinstance(m, MixedLoRALinear) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before["model"].keys() and all(torch.equal(after[k], v) for k, v in before["model"].items())
    assert {k: p.requires_grad for k, p in model.named_parameters()} == before["grad"]
    assert all(
        torch.equal(old.modules[p].A, a) and torch.equal(old.modules[p].B, b) for p, (a, b) in before["old"].items()
    )
    assert state.names == before["names"] == ["old"] and torch.equal(state.keys, before["keys"])
    assert state.mean_attention == before["attention"]
    assert all(torch.equal(v, before["projector"][k]) for k, v in state.projector.state_dict().items())
    # the new state: two blocks, the old key kept, the new task's texts routed to the new block
    new_state = result.state
    assert new_state.names == ["old", "new"] and torch.equal(new_state.keys[0], state.keys[0])
    assert set(new_state.mean_attention) == {"old", "new"} and new_state.mean_attention["new"]["new"] > 0.5
    w_new = new_state.attention(pooler([e["route_text"] for e in NEW]))
    assert w_new[:, 1].mean() > 0.7 and (w_new.argmax(-1) == 1).float().mean() > 0.8, w_new
    w_old = new_state.attention(pooler([e["route_text"] for e in OLD]))
    assert w_old[:, 0].mean() > 0.7, w_old  # ARM: the old task still goes to the old block
    # the new task's answer loss: served as before (old block alone) vs with the new block at its attention
    loss_before = rows_mixed_loss(model, tok, [old], torch.ones(len(NEW), 1), NEW)
    loss_after = rows_mixed_loss(model, tok, [old, result.adapter], w_new, NEW)
    assert loss_after < loss_before - 0.1, (loss_before, loss_after)  # ~10.8 -> ~10.45 here
    progress = trained["progress"]
    assert [p.step for p in progress] == list(range(1, len(progress) + 1)) and progress[-1].step == progress[
        -1
    ].total == 24
    assert progress[-1].tokens > 0 and progress[-1].loss < progress[0].loss


def test_saved_block_serves_the_trained_mix(trained, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, pooler, old, result = (trained[k] for k in ("model", "pooler", "old", "result"))
    assert all(f.A.dtype == torch.float32 and f.A.device.type == "cpu" for f in result.adapter.modules.values())
    save_peft_adapter(result.adapter, tmp_path, "tiny-llama", CFG.alpha, CFG.target_modules)
    loaded = load_peft_adapter(tmp_path)
    texts = [NEW[0]["route_text"], OLD[0]["route_text"]]
    w = result.state.attention(pooler(texts))
    x = trained["tok"](texts, return_tensors="pt", padding=True)
    with torch.no_grad(), weighted_mix(model, [old, result.adapter]) as mix:
        mix.set_weights(w)
        want = model(**x).logits
    bank = LoRABank(copy.deepcopy(model))
    bank.add("old", old)
    bank.add("new", loaded)
    with torch.no_grad(), bank.mixed([[("old", float(r[0])), ("new", float(r[1]))] for r in w]):
        got = bank.model(**x).logits
    assert torch.allclose(got, want, atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(model(**x).logits, want, atol=1e-3)  # the blocks changed the output


def test_the_answer_loss_alone_moves_the_router(trained) -> None:  # type: ignore[no-untyped-def]
    """No route CE, no ARM: key and projector still move, through the attention weights of the mix."""
    state = dataclasses.replace(trained["state"], settings=dataclasses.replace(SETTINGS, arm_lambda=0.0))
    pooled = trained["pooler"]([e["route_text"] for e in NEW[:4]])
    start = state.initial_key(state.projector, pooled, [*state.names, "new"])
    cfg = dataclasses.replace(CFG, epochs=1.0)
    result = train_attentive(
        trained["model"],
        trained["tok"],
        "new",
        NEW[:4],
        [],
        cfg,
        state,
        trained["pooler"],
        {"old": trained["old"]},
        {},
        route_weight=0.0,
    )
    assert result.state.keys is not None and result.state.projector is not None and state.projector is not None
    assert not torch.allclose(result.state.keys[1], start)
    proj = result.state.projector.state_dict()
    assert any(not torch.equal(v, proj[k]) for k, v in state.projector.state_dict().items())


def test_missing_earlier_block_is_a_key_error(trained) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KeyError, match="old"):
        train_attentive(
            trained["model"], trained["tok"], "other", NEW[:2], [], CFG, trained["state"], trained["pooler"], {}, {}
        )


def test_cancel_gives_the_model_back(trained) -> None:  # type: ignore[no-untyped-def]
    model = trained["model"]
    with pytest.raises(Cancelled):
        train_attentive(
            model,
            trained["tok"],
            "new",
            NEW[:2],
            [],
            CFG,
            trained["state"],
            trained["pooler"],
            {"old": trained["old"]},
            {},
            should_stop=lambda: True,
        )
    assert not any(isinstance(m, MixedLoRALinear) for m in model.modules())
    assert not model.training and all(p.requires_grad for p in model.parameters())


def test_checkpointing_gives_the_same_block_key_and_projector(tiny_base) -> None:  # type: ignore[no-untyped-def]
    """The mix's weights come from the projector outside the decoder layers; recomputing the layers in backward
    must still send their gradient to the projector and key, and the mix's dropout must draw the same masks."""
    tok = AutoTokenizer.from_pretrained(str(tiny_base.path))
    runs = {}
    for on in ("off", "on"):
        cfg = dataclasses.replace(CFG, epochs=3, dropout=0.2, gradient_checkpointing=on)
        torch.manual_seed(0)  # the mix's dropout draws from the global RNG: both runs from the same state
        model = AutoModelForCausalLM.from_pretrained(str(tiny_base.path)).eval()
        pooler = TokenPooler(model.get_input_embeddings().weight, tok)
        first = train_attentive(model, tok, "old", OLD[:8], [], cfg, SAPTState(pooler.dim, SETTINGS), pooler, {}, {})
        routes = {"old": [e["route_text"] for e in OLD[:3]]}
        result = train_attentive(
            model, tok, "new", NEW[:8], [], cfg, first.state, pooler, {"old": first.adapter}, routes
        )
        assert not checkpointing_active(model)
        runs[on] = (first, result)
    for off, on in zip(runs["off"], runs["on"]):
        for path, f in off.adapter.modules.items():
            g = on.adapter.modules[path]
            assert torch.allclose(f.A, g.A, rtol=0, atol=1e-6) and torch.allclose(f.B, g.B, rtol=0, atol=1e-6), path
    off_state, on_state = runs["off"][1].state, runs["on"][1].state
    assert not torch.equal(off_state.keys[1], runs["off"][0].state.keys[0])  # the new key was trained
    assert torch.allclose(off_state.keys, on_state.keys, rtol=0, atol=1e-6)
    for name, value in off_state.projector.state_dict().items():
        assert torch.allclose(value, on_state.projector.state_dict()[name], rtol=0, atol=1e-6), name
