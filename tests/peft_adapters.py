"""PEFT adapters made the way their users make them, for the import and export tests: trained with plain PEFT code
on a base model folder, saved by PEFT, tarred as a user would, and asked for greedy answers through PEFT itself."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPPOSITES = {
    "hot": "cold",
    "tall": "short",
    "happy": "sad",
    "fast": "slow",
    "light": "dark",
    "early": "late",
    "open": "closed",
    "full": "empty",
    "loud": "quiet",
    "rich": "poor",
    "wet": "dry",
    "young": "old",
}
INSTRUCTION = "Give the opposite of the word."


def opposite_rows(answers: bool) -> list[dict[str, str]]:
    """The adapter's task as import examples: instruction rows, with or without their answers."""
    return [
        {"instruction": INSTRUCTION, "input": w, **({"output": o} if answers else {})} for w, o in OPPOSITES.items()
    ]


def chat_ids(tok: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The prompt ids an engine serves for a chat (its template, no special tokens added again)."""
    text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def train_peft(
    base: Path,
    folder: Path,
    steps: int = 20,
    lr: float = 3e-3,
    pairs: Sequence[tuple[str, str]] | None = None,
    **lora: Any,
) -> Path:
    """A LoRA trained with plain PEFT on (user turn, answer) `pairs` (default: the opposites), on the answer tokens
    only, one pair a step, saved by PEFT's save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = {"r": 4, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": list(ALL_MODULES), **lora}
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **config))
    rows = []
    for user, reply in pairs or [(f"{INSTRUCTION}\n{w}", o) for w, o in OPPOSITES.items()]:
        prompt = chat_ids(tok, [{"role": "user", "content": user}])
        answer = tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    peft_model.train()
    for step in range(steps):
        ids, labels = rows[step % len(rows)]
        loss = peft_model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft_model.save_pretrained(str(folder))
    return folder


def peft_answers(base: Path, folder: Path | None, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Greedy answers of `generate` on the base model with the adapter at `folder` loaded by PEFT (None: without)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if folder is not None:
        model = PeftModel.from_pretrained(model, str(folder))
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([chat_ids(tok, [{"role": "user", "content": p}])])
        with torch.no_grad():
            new = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


def tar_gz(folder: Path, top: str | None = "adapter") -> bytes:
    """The folder as a user tars it (`tar czf a.tgz adapter/`): every file in it, model card included."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        archive.add(str(folder), arcname=top or ".")
    return out.getvalue()
