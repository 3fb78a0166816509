"""A chat through the base model's chat template, as token ids: one function for every engine and the ingress."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders OpenAI tools itself (it reads a `tools` variable); a template that does
    not would drop them, so the API then writes them into the messages (server/chat/tools.py)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def encode_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[int]:
    """The template applied with the generation prompt, then tokenized without adding special tokens again."""
    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **extra
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
