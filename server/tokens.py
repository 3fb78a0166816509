"""The base model's tokenizer as the API shows it: token text and bytes (logprobs), the prompt of a completion
(text or token ids) and the tokenize endpoints.

A token of a byte-level BPE (GPT-2's, SmolLM2's) is a string over 256 printable stand-ins for the bytes 0-255;
mapped back, it gives the token's exact bytes, which may be part of a UTF-8 character: OpenAI's `bytes` field.
SentencePiece tokens (LLaMA-2's) are text with '▁' for a space and `<0xNN>` for a raw byte.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode


class Vocabulary:
    def __init__(self, path: str | Path) -> None:
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
        self.size = len(self.tokenizer)
        self._bytes: list[bytes] | None = None
        self._lock = threading.Lock()

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes, exactly (built for the whole vocabulary on first use)."""
        if self._bytes is None:
            with self._lock:
                if self._bytes is None:
                    self._bytes = self._all_bytes()
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def token_text(self, token: int) -> str:
        """The token's text: its bytes as UTF-8, a part of a character shown as U+FFFD (as vLLM shows it)."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _all_bytes(self) -> list[bytes]:
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(self.size)))
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
            out = []
            for piece in pieces:
                raw = [to_byte.get(ch) for ch in piece or ""]
                out.append(bytes(raw) if None not in raw else (piece or "").encode())  # type: ignore[arg-type]
            return out
        return [_sentencepiece_bytes(p or "") for p in pieces]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text's tokens (a completion's prompt; vLLM's default adds the tokenizer's special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def outside(self, ids: Sequence[int]) -> int | None:
        """The first id that is no token of this vocabulary, or None."""
        return next((t for t in ids if not 0 <= t < self.size), None)

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's settings and chat template (what a client needs to tokenize as
        the server does)."""
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": tok.model_max_length,
            "vocab_size": self.size,
        }


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()
