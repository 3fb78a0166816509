"""The text side every engine shares: a chat through the base model's chat template as token ids, and the output
constraints checked (compiled, for the hf engine) before a request is submitted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .grammar import GrammarCache
from .protocol import SamplingParams


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


class ChatFront:
    """Mixed into the engines (and the ingress's remote engine): `encode_chat`, `takes_tools` and `prepare` of the
    engine contract, over one tokenizer and its compiled constraints."""

    tokenizer: Any
    takes_tools: bool
    grammars: GrammarCache

    def _front(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """`vocab_size`: the model's logits width where it differs from the tokenizer's."""
        self.tokenizer = tokenizer
        self.takes_tools = takes_tools(tokenizer)
        self.grammars = GrammarCache(tokenizer, vocab_size)  # ~0.3 s: every token's bytes, once

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return encode_chat(self.tokenizer, messages, tools)

    def prepare(self, params: SamplingParams) -> None:
        if params.constraint is not None:
            self.grammars.compile(params.constraint)
