"""SAPT pseudo replay: generator LoRA training, sampling, and leaving the base model untouched."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skillpool.trainer.loop import Cancelled, Progress, collate
from skillpool.trainer.pseudo import (
    GeneratorConfig,
    encode_text,
    generate_pseudo_inputs,
    pseudo_replay,
    train_generator,
)

TEXTS = [
    "What is the capital of France?",
    "Classify the sentiment: the movie was great",
    "Translate to German: good morning",
    "Add 2 and 3",
    "Name a red fruit",
    "Who wrote Hamlet?",
]
# The tiny random model's logits are nearly flat (unit-RMS hidden states against 0.02-std tied
# embeddings), so q/v LoRA alone moves its loss by well under a nat; a LoRA on lm_head too lets
# it actually fit, which these tests need to see learning clearly and fast.
FIT = GeneratorConfig(rank=16, alpha=32.0, learning_rate=1e-2, target_modules=["q_proj", "v_proj", "lm_head"])
# PEFT warns that lm_head is tied to the embeddings; harmless here, as these adapters are never merged or saved.
pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")


@pytest.fixture(scope="module")
def tok(tiny_base):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_base.path))


def load(tiny_base):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_base.path))


def text_loss(model, tok, texts: list[str]) -> float:  # type: ignore[no-untyped-def]
    batch = collate([encode_text(tok, t, 64) for t in texts], tok.pad_token_id)
    with torch.no_grad():
        return float(model(**batch).loss)


def test_only_the_text_and_eos_are_trained(tok) -> None:  # type: ignore[no-untyped-def]
    ids, labels = encode_text(tok, "Add 2 and 3", 64)
    text_ids = tok("Add 2 and 3", add_special_tokens=False)["input_ids"]
    assert [x for x in labels if x != -100] == text_ids + [tok.eos_token_id] == ids[-len(text_ids) - 1 :]
    assert tok.decode(ids[: len(ids) - len(text_ids) - 1]) == "__gen__\n"
    cut_ids, cut_labels = encode_text(tok, "Add 2 and 3", len(ids) - 2)  # truncated: no EOS to learn
    assert cut_ids == ids[:-2] and tok.eos_token_id not in cut_labels


def test_training_reduces_the_generator_loss(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    model = load(tiny_base)
    before = text_loss(model, tok, TEXTS)
    seen: list[Progress] = []
    cfg = replace(FIT, epochs=10.0, batch_size=3)
    peft_model = train_generator(model, tok, TEXTS, cfg, on_progress=seen.append)
    after = text_loss(peft_model, tok, TEXTS)
    assert len(seen) == seen[-1].total == 20
    assert seen[-1].loss is not None and seen[0].loss is not None and seen[-1].loss < seen[0].loss - 2
    assert after < before - 2, (before, after)


@pytest.mark.parametrize("text", ["the quick brown fox jumps", "<|im_start|>"])
def test_overfit_generator_reproduces_its_text_and_drops_empties(tiny_base, tok, text: str) -> None:  # type: ignore[no-untyped-def]
    cfg = replace(FIT, epochs=80.0, max_new_tokens=12, temperature=0.0)
    peft_model = train_generator(load(tiny_base), tok, [text] * 8, cfg)
    out = generate_pseudo_inputs(peft_model, tok, 2, cfg)
    # A special token alone decodes to "": every sample (and resample) is empty and dropped.
    expected = tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True).strip()
    assert out == ([expected] * 2 if expected else [])


def test_samples_are_n_strings_reproducible_per_seed(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    cfg = GeneratorConfig(epochs=1.0, max_new_tokens=8, batch_size=4)
    peft_model = train_generator(load(tiny_base), tok, TEXTS, cfg)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = generate_pseudo_inputs(peft_model, tok, 6, cfg)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is not consumed
    assert len(first) == 6 and all(isinstance(s, str) and s and s == s.strip() for s in first)
    assert generate_pseudo_inputs(peft_model, tok, 6, cfg) == first
    assert generate_pseudo_inputs(peft_model, tok, 6, replace(cfg, seed=1)) != first
    assert generate_pseudo_inputs(peft_model, tok, 0, cfg) == []


def snapshot(model):  # type: ignore[no-untyped-def]
    return {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}, model.training


def assert_unchanged(model, snap) -> None:  # type: ignore[no-untyped-def]
    params, training = snap
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and model.training == training
    for name, (value, requires_grad) in params.items():
        assert torch.equal(now[name], value) and now[name].requires_grad == requires_grad, name
    assert not any("lora" in name for name, _ in model.named_modules())


def test_pseudo_replay_leaves_the_base_model_bit_identical(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    model = load(tiny_base)
    model.train()  # a non-default mode, to see that it is restored too
    snap = snapshot(model)
    cfg = GeneratorConfig(learning_rate=1e-2, epochs=2.0, max_new_tokens=8)
    out = pseudo_replay(model, tok, TEXTS, 3, cfg)
    assert len(out) == 3 and all(out)
    assert_unchanged(model, snap)
    with pytest.raises(Cancelled):
        pseudo_replay(model, tok, TEXTS, 3, cfg, should_stop=lambda: True)
    assert_unchanged(model, snap)


def test_bad_arguments_are_rejected(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    model = load(tiny_base)
    cfg = GeneratorConfig(epochs=1.0, max_new_tokens=4)
    for texts in ([], ["", "  \n"]):
        with pytest.raises(ValueError, match="texts is empty"):
            train_generator(model, tok, texts, cfg)
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        pseudo_replay(model, tok, TEXTS, -1, cfg)
    with pytest.raises(ValueError, match="leaves no room"):
        train_generator(model, tok, TEXTS, GeneratorConfig(max_seq_len=3))
    peft_model = train_generator(model, tok, TEXTS, cfg)
    with pytest.raises(ValueError, match="n must be >= 0, got -2"):
        generate_pseudo_inputs(peft_model, tok, -2, cfg)
