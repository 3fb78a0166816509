"""Incremental detokenization and stop strings, per request.

Decoding the whole answer again for every token is quadratic in its length; vLLM decodes only a window:
the text of ids[prefix:] minus the text of ids[prefix:read] is what the newest tokens add. With a
byte-level BPE the window's text is exact once no character is split (a trailing U+FFFD means a
multi-byte character is not complete yet: wait for the next token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window
        self._read = 0  # ids before this are already text

    def push(self, token: int) -> str:
        """Add one token; the text it completes (may be '' while a character is incomplete)."""
        self.ids.append(token)
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the end of the answer)."""
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars might be the start of a stop string (not yet safe to emit)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class TextStream:
    """The answer's text as it grows: what may be sent now, and whether a stop string ended it."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0  # chars of `text` already sent

    def push(self, token: int, stops: bool = True) -> tuple[str, bool]:
        """(text safe to send now, stopped): on a stop string the text before it is the rest of the answer.
        `stops` False: no stop string ends the answer yet (vLLM's min_tokens)."""
        return self._grow(self.detok.push(token), stops)

    def finish(self) -> str:
        """The held-back rest when the answer ends for another reason (EOS, length)."""
        delta, stopped = self._grow(self.detok.flush())
        if stopped:
            return delta
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return delta + rest

    def _grow(self, delta: str, stops: bool = True) -> tuple[str, bool]:
        if not delta:
            return "", False
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        for s in self.stops if stops else ():
            at = self.text.find(s, start)
            if at != -1:
                out = self.text[self.sent : at] if at > self.sent else ""
                self.text, self.sent = self.text[:at], at
                return out, True
        safe = len(self.text) - stop_holdback(self.text, self.stops)
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False
