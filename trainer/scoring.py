"""Answer scoring, shared by the quality gate and `skillpool eval`: first-word exact match for
classification-style tasks, ROUGE-L F1 for generation, and batched greedy answers to score."""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import nullcontext

from skillpool.lora.bank import LoRABank
from skillpool.lora.mix import Mix

_WORD = re.compile(r"\w+", re.UNICODE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def first_word_match(prediction: str, reference: str) -> float:
    p, r = _words(prediction), _words(reference)
    return float(bool(p) and bool(r) and p[0] == r[0])


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lowercased word tokens (LCS-based)."""
    p, r = _words(prediction), _words(reference)
    if not p or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for pw in p:
        cur = [0]
        for j, rw in enumerate(r):
            cur.append(prev[j] + 1 if pw == rw else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def is_classification(answers: Sequence[str], max_labels: int = 20, max_words: int = 4) -> bool:
    """A task whose answers are a small set of short labels is scored by exact match."""
    labels = {a.strip().lower() for a in answers}
    return 0 < len(labels) <= max_labels and all(len(_words(a)) <= max_words for a in labels)


def metric_for(answers: Sequence[str]) -> str:
    return "exact_match" if is_classification(answers) else "rouge_l"


def score(metric: str, prediction: str, reference: str) -> float:
    return first_word_match(prediction, reference) if metric == "exact_match" else rouge_l(prediction, reference)


def mean_score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> float:
    if not references:
        return 0.0
    return sum(score(metric, p, r) for p, r in zip(predictions, references)) / len(references)


def generate_greedy(  # type: ignore[no-untyped-def]
    model,
    tokenizer,
    prompts: Sequence[list[dict[str, str]]],
    max_new_tokens: int,
    batch_size: int = 16,
    bank: LoRABank | None = None,
    mixes: Sequence[Mix] | None = None,
) -> list[str]:
    """Greedy answers for chat prompts, batched with left padding.

    With `bank` and `mixes`, row i is generated under LoRA mix `mixes[i]` (empty: the base model), the
    same per-row mix the server applies, so a routed answer can be scored without a server.
    """
    import torch

    if (bank is None) != (mixes is None) or (mixes is not None and len(mixes) != len(prompts)):
        raise ValueError("bank and mixes go together, one mix per prompt")
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(next(model.parameters()).device) for k, v in enc.items()}
            rows = [m.ranked for m in mixes[i : i + batch_size]] if mixes is not None else []
            mixing = bank.mixed(rows) if bank is not None and mixes is not None else nullcontext()
            with torch.no_grad(), mixing:
                gen = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id
                    if tokenizer.pad_token_id is not None
                    else tokenizer.eos_token_id,
                )
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return out
