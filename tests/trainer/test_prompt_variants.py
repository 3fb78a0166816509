"""trainer/prompt_variants.py: the other wordings a skill trains on (TrainConfig.prompt_variants)."""

from __future__ import annotations

import json
import random
import re

import pytest

from skillpool.trainer.config import MAX_VARIANT_COPIES, ConfigError, TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.prompt_variants import KINDS, label_set, reword, split_prompt, variant, with_variants
from skillpool.trainer.records import Example

INSTRUCTION = 'Classify the review as "POS" if it is positive or as "NEG" if it is negative.'
OPTIONS = "What is the sentiment of the paragraph? Choose one from the option. Option: Good, Bad."


def rows(instruction: str = INSTRUCTION, labels: tuple[str, ...] = ("POS", "NEG"), n: int = 24) -> list[Example]:
    lines = [
        {
            "instruction": instruction,
            "input": f"review number {i}: it was {'great' if i % 2 else 'dull'}",
            "output": labels[(i + 1) % len(labels)],
        }
        for i in range(n)
    ]
    return parse_jsonl("\n".join(json.dumps(r) for r in lines).encode())


def user_text(ex: Example) -> str:
    return "\n".join(m["content"] for m in ex["messages"])


def test_split_prompt_recovers_instruction_and_input_and_leaves_others_alone() -> None:
    ex = rows()[0]
    assert split_prompt(ex) == (INSTRUCTION, "review number 0: it was dull")
    chat = parse_jsonl(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U"},
                    {"role": "assistant", "content": "A"},
                ]
            }
        ).encode()
    )[0]
    assert split_prompt(chat) == ("S", "U")
    only_input = parse_jsonl(json.dumps({"instruction": "", "input": "hello", "output": "x"}).encode())[0]
    only_instruction = parse_jsonl(json.dumps({"instruction": "do it", "input": "", "output": "x"}).encode())[0]
    assert split_prompt(only_input) is None and split_prompt(only_instruction) is None
    assert variant(only_input, "system", [], random.Random(0)) is only_input


def test_each_kind_keeps_input_answer_and_router_texts() -> None:
    ex = rows()[3]
    for kind in KINDS:
        out = variant(ex, kind, ["NEG", "POS"], random.Random(1))
        assert "review number 3: it was great" in user_text(out), kind
        assert out["answer"] == ex["answer"] == "POS"
        assert (out["route_text"], out["route_input"]) == (ex["route_text"], ex["route_input"])
    system = variant(ex, "system", [], random.Random(0))["messages"]
    assert system == [
        {"role": "system", "content": INSTRUCTION},
        {"role": "user", "content": "review number 3: it was great"},
    ]
    assert variant(ex, "input_only", [], random.Random(0))["messages"] == [
        {"role": "user", "content": "review number 3: it was great"}
    ]
    first = variant(ex, "input_first", [], random.Random(0))["messages"][0]["content"]
    assert first == f"review number 3: it was great\n{INSTRUCTION}"


def test_rewording_lists_the_training_labels_as_spelled() -> None:
    labels = label_set(["Good", "Bad", "Good", "Bad"])
    assert labels == ["Bad", "Good"]
    seen = set()
    for seed in range(40):
        text = reword(OPTIONS, labels, random.Random(seed))
        assert "Option: Good, Bad" not in text  # the instruction's own list is replaced by the labels' list
        assert re.search(r"\bGood\b", text) and re.search(r"\bBad\b", text), text
        seen.add(text)
    assert len(seen) > 10  # other stems, orders and list formats
    respelled = [reword(INSTRUCTION, ["NEG", "POS"], random.Random(seed)) for seed in range(40)]
    assert all(re.search(r"\bPOS\b", t) and re.search(r"\bNEG\b", t) for t in respelled)  # the label line's
    assert any(re.search(r'"(pos|Pos)"', t) for t in respelled)  # the stem's mention spelled as a user might
    assert label_set(["a long free-form answer that is not a label at all", "another sentence of prose here"]) == []
    assert label_set(["x", "y"]) == []  # every answer distinct: not a label task


def test_with_variants_is_deterministic_and_shares_the_rows() -> None:
    train = rows()
    a, b = with_variants(train, 0.5, seed=7), with_variants(train, 0.5, seed=7)
    assert a == b
    assert a != with_variants(train, 0.5, seed=8)
    changed = [x for x, y in zip(a, train) if x["messages"] != y["messages"]]
    assert len(a) == len(train) and 1 <= len(changed) <= 12  # round(0.5 × 24) chosen; a rewording may keep a row
    assert [x["answer"] for x in a] == [y["answer"] for y in train]
    all_variants = with_variants(train, 1.0, seed=0)
    assert any(x["messages"][0]["role"] == "system" for x in all_variants)
    assert {x["answer"] for x in all_variants} == {"POS", "NEG"}
    assert with_variants(train, 0.0, seed=0) is train


def test_added_variants_keep_every_uploaded_row_and_follow_it() -> None:
    train = rows()
    replaced = with_variants(train, 0.5, seed=7)
    added = with_variants(train, 0.5, seed=7, added=True)
    assert [x for x in added if x in train] == train  # every uploaded row, in its order
    extra = [x for x in added if x not in train]
    # the same rows are chosen and worded as in the replacing mode (a rewording may leave one as uploaded)
    assert extra == [x for x, y in zip(replaced, train) if x["messages"] != y["messages"]]
    assert len(added) == len(train) + 12  # round(0.5 × 24) more rows
    for i, x in enumerate(added):
        if x not in train:  # a variant comes right after its own uploaded row, with its answer
            assert added[i - 1]["route_input"] == x["route_input"] and added[i - 1]["answer"] == x["answer"]
    assert with_variants(train, 0.0, seed=0, added=True) is train


def test_copies_follow_each_row_with_that_many_different_wordings() -> None:
    train = rows()
    one = with_variants(train, 1.0, seed=7, added=True)
    assert with_variants(train, 1.0, seed=7, added=True, copies=1) == one  # the default draws as before
    two = with_variants(train, 1.0, seed=7, added=True, copies=2)
    assert len(two) == 3 * len(train) and [x for x in two if x in train] == train
    assert two[1] == one[1]  # the first row's first variant is drawn as with one copy
    for i, ex in enumerate(train):
        first, second = two[3 * i + 1], two[3 * i + 2]
        assert two[3 * i] == ex and first["answer"] == second["answer"] == ex["answer"]
        assert first["route_input"] == second["route_input"] == ex["route_input"]
        assert ex["messages"] != first["messages"] != second["messages"] != ex["messages"]
    for bad in (0, 5):
        with pytest.raises(ValueError, match="prompt_variant_copies"):
            with_variants(train, 1.0, seed=0, added=True, copies=bad)
    with pytest.raises(ValueError, match="only when added"):
        with_variants(train, 1.0, seed=0, copies=2)


def test_copies_is_a_checked_hyperparameter() -> None:
    assert TrainConfig().prompt_variant_copies == 2
    # replaced rows take one wording: turning additions off alone still gives a valid config
    assert TrainConfig.from_dict({"prompt_variants_added": False}).prompt_variant_copies == 1
    assert TrainConfig.from_dict({"prompt_variants_added": True}).prompt_variant_copies == 2
    assert MAX_VARIANT_COPIES == len(KINDS) - 1  # each copy a different kind, the first drawn from all
    assert TrainConfig.from_dict({"prompt_variant_copies": 3}).prompt_variant_copies == 3
    for bad in (0, 5, -1):
        with pytest.raises(ConfigError, match=r"config.prompt_variant_copies: must be in \[1, 4\]"):
            TrainConfig.from_dict({"prompt_variant_copies": bad})
    with pytest.raises(ConfigError, match="config.prompt_variant_copies"):
        TrainConfig.from_dict({"prompt_variant_copies": 2, "prompt_variants_added": False})
    with pytest.raises(ConfigError, match="config.prompt_variant_copies: must be a int"):
        TrainConfig.from_dict({"prompt_variant_copies": 1.5})


def test_zero_fraction_keeps_todays_token_sequences(tiny_base) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from skillpool.trainer.lora_train import encode_example

    tok = AutoTokenizer.from_pretrained(str(tiny_base.path))
    train = rows(n=6)
    today = [encode_example(tok, e, 512) for e in train]
    assert [encode_example(tok, e, 512) for e in with_variants(train, 0.0, seed=3)] == today
    # {"prompt_variants": 0.0} over the default prompt_variants_added=True trains exactly as before too
    assert [encode_example(tok, e, 512) for e in with_variants(train, 0.0, seed=3, added=True)] == today
    assert [encode_example(tok, e, 512) for e in with_variants(train, 1.0, seed=3)] != today


def test_the_fraction_is_a_checked_hyperparameter() -> None:
    # on by default: each row's variants beside it (the config the paraphrase-gap criterion was measured at)
    assert (TrainConfig().prompt_variants, TrainConfig().prompt_variants_added) == (1.0, True)
    assert TrainConfig.from_dict({"prompt_variants": 1}).prompt_variants == 1.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"config.prompt_variants: must be in \[0, 1\]"):
            TrainConfig.from_dict({"prompt_variants": bad})
    with pytest.raises(ConfigError, match="config.prompt_variants"):
        TrainConfig.from_dict({"prompt_variants": "half"})
    with pytest.raises(ValueError, match="prompt_variants"):
        with_variants(rows(), 2.0, seed=0)
    assert TrainConfig.from_dict({"prompt_variants_added": True}).prompt_variants_added is True
    for bad_flag in (1, "yes"):
        with pytest.raises(ConfigError, match="config.prompt_variants_added: must be a bool"):
            TrainConfig.from_dict({"prompt_variants_added": bad_flag})


def test_a_job_trains_the_block_on_variants_and_keeps_the_keys(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from skillpool.adapters_store.store import SkillStore
    from skillpool.router import Router
    from skillpool.trainer.skill_trainer import SkillTrainer

    train = rows(n=16)
    recs, totals = {}, {}
    # -1: 0.0 again, to show a job repeats and a difference is the variants'; 2: 1.0 with the variants added
    for share in (0.0, 1.0, -1.0, 2.0):
        trainer = SkillTrainer(SkillStore(tmp_path / str(share)), Router(embedder), tiny_base)
        cfg = TrainConfig(
            epochs=1.0,
            batch_size=8,
            max_seq_len=96,
            max_eval_examples=2,
            prompt_variants=min(max(share, 0.0), 1.0),
            prompt_variants_added=share == 2.0,
            prompt_variant_copies=2 if share == 2.0 else 1,  # replaced rows take one wording
        )
        seen: list[int] = []
        recs[share] = trainer.run("s", train, cfg, force=True, on_progress=lambda p, seen=seen: seen.append(p.total))
        totals[share] = max(seen)
    assert totals[0.0] == totals[1.0] < totals[2.0]  # replacing keeps the steps; adding grows them
    plain, varied = recs[0.0], recs[1.0]
    assert varied.meta["training"]["config"]["prompt_variants"] == 1.0
    keys, keys_varied = plain.router_tensors(), varied.router_tensors()
    assert keys.keys() == keys_varied.keys() and all(torch.equal(keys[k], keys_varied[k]) for k in keys)
    a, b, again = plain.adapter().modules, varied.adapter().modules, recs[-1.0].adapter().modules
    assert all(torch.equal(a[m].B, again[m].B) for m in a)
    assert any(not torch.equal(a[m].B, b[m].B) for m in a)  # the block saw other prompts
