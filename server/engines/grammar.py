"""Output constraints as a token mask per row: llguidance's grammars, compiled once, stepped with each row's tokens.

A `Constraint` (a JSON schema, a regex, a list of choices, a Lark or GBNF grammar) becomes an llguidance grammar;
`GrammarCache` compiles it into a matcher once per distinct constraint (least recently used evicted) on the
caller's thread, so the engine's loop only copies a compiled matcher (microseconds) when a row is admitted. Each
step the rows' masks are filled (llguidance's executor, in parallel, without the GIL) and applied to the batch's
logits right before sampling; a row's matcher then takes the token it sampled. The vllm engine validates here too,
so both engines take and refuse the same constraints.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from .protocol import Constraint, ConstraintError

CACHE_SIZE = 256  # compiled grammars kept (a prototype matcher each: its lexer states grow as it is used)
# llguidance's own bounds on a grammar's size and on the work of one mask: a grammar past them fails its row alone
LIMITS = llguidance.LLParserLimits()


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint, as vLLM's guidance backend builds it from the same fields."""
    try:
        fmt = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]
        return llguidance.grammar_from(fmt, c.spec)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError) as e:
        raise ConstraintError(f"invalid {c.kind}: {e}") from None


class GrammarCache:
    """Compiled constraints for one tokenizer: compile (and check) on any thread; `matcher` for a row."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, size: int = CACHE_SIZE) -> None:
        """`vocab_size`: the model's logits width when it differs from the tokenizer's (a padded embedding)."""
        # ~0.3 s: the tokenizer's every token as bytes, once per engine
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = self.tokenizer.vocab_size
        self.size = size
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = self.hits = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def compile(self, c: Constraint) -> llguidance.LLMatcher:
        """The constraint's compiled matcher (its initial state), from the cache or built now (milliseconds for a
        schema of a few dozen properties: call it off the engine's loop). Raises ConstraintError."""
        with self._lock:
            proto = self._compiled.get(c)
            if proto is not None:
                self._compiled.move_to_end(c)
                self.hits += 1
                return proto
        text = grammar_text(c)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer, limits=LIMITS)
        if error:
            raise ConstraintError(f"invalid {c.kind}: {error.strip()}")
        proto = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=LIMITS)
        if proto.is_error():
            raise ConstraintError(f"invalid {c.kind}: {proto.get_error()}")
        # the first mask builds the lexer's first states, which copies share: a row's first step stays cheap
        warm = proto.deep_copy()
        warm.compute_bitmask()
        if warm.is_error():
            raise ConstraintError(f"invalid {c.kind}: {warm.get_error()}")
        with self._lock:
            self.compiles += 1
            self._compiled[c] = proto
            self._compiled.move_to_end(c)
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return proto

    def matcher(self, c: Constraint) -> RowGrammar:
        """A fresh matcher for one row (compiles only if the constraint left the cache since it was prepared)."""
        return RowGrammar(self.compile(c).deep_copy())


class RowGrammar:
    """One row's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def error(self) -> str | None:
        """Why the grammar can go no further (a step past llguidance's limits, a token it refused), or None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the grammar can go no further"

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes no more tokens: the row ends here."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def advance(self, token: int) -> bool:
        """Take the sampled token; False when the grammar refuses it (the row then fails alone)."""
        return bool(self.matcher.consume_token(token))


class Masks:
    """Fills the constrained rows' token masks and applies them to a batch's logits. The bits are unpacked and
    applied with numpy on a CPU: torch would spread these small element-wise steps over its thread pool, which on
    a busy CPU waits for every thread."""

    def __init__(self, vocab_size: int, threads: int = 1) -> None:
        """`vocab_size`: the grammars' tokenizer's (GrammarCache.vocab_size)."""
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))

    def allowed(self, grammars: Sequence[RowGrammar]) -> np.ndarray:
        """One row of booleans per grammar over the tokenizer's vocabulary (words × 32 columns): the tokens it
        allows next; none for a grammar in error (llguidance would allow the end, as if it were complete)."""
        bitmask = np.zeros((len(grammars), self.words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(g.matcher, k) for k, g in enumerate(grammars)], bitmask.ctypes.data, self.words * 4, len(grammars)
        )
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
        for k, g in enumerate(grammars):
            if g.matcher.is_error():
                allowed[k] = False
        return allowed

    def apply(self, logits: torch.Tensor, grammars: Sequence[RowGrammar | None]) -> torch.Tensor:
        """`logits` (rows × vocabulary) with each constrained row's disallowed tokens at -inf, in place. A row whose
        grammar allows nothing (in error, or every token refused) is all -inf: its sampling fails, it alone ends."""
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        allowed = self.allowed([g for _, g in rows])
        if allowed.shape[1] < vocab:  # logits past the tokenizer's vocabulary are never allowed
            allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
        refused = ~allowed[:, :vocab]
        index = torch.tensor([i for i, _ in rows], device=logits.device)
        # a row whose own logits are not finite fails as any row does: masking must not hide a NaN it refuses
        faulty = ~(torch.isfinite(logits[index].amax(dim=-1)) & torch.isfinite(logits[index].amin(dim=-1)))
        if logits.device.type == "cpu":
            view = logits.numpy()
            for k, (i, _) in enumerate(rows):
                np.putmask(view[i], refused[k], -np.inf)
        else:
            mask = torch.from_numpy(refused).to(logits.device)
            logits[index] = logits[index].masked_fill(mask, float("-inf"))
        if bool(faulty.any()):
            logits[index[faulty]] = float("nan")
        return logits


def json_text(value: Any) -> str:
    """A JSON value as constraint text: compact, key order kept (a schema's property order is the output's)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
