"""From a batch's logits to each row's next token, vectorized over the rows: OpenAI's and vLLM's sampling options.

Every option is a per-row tensor over the batch's rows (or the rows that use it), never a per-row loop over the
vocabulary. The order is vLLM's: `min_tokens` and `logit_bias`, then the penalties (repetition, frequency,
presence), then temperature, `min_p`, `top_k` and `top_p`. A sampled row draws one uniform number from its own
generator (seeded rows reproduce whatever their batch-mates are) and takes the token where it falls in the
distribution's cumulative sum. Logprobs are the model's own: the log-softmax of the raw logits, before any option
changes them (vLLM's default `raw_logprobs`), so that they say what the model thinks of a token whatever the
request asked to favour.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .protocol import SamplingParams, TokenLogprob


class Pick(NamedTuple):
    token: int
    logprob: TokenLogprob | None  # with params.logprobs


def finite_rows(logits: Tensor) -> list[bool]:
    """Whether each row's logits are all finite. A NaN or an inf anywhere in a row shows in its max or min: two
    reductions, where isfinite(logits).all() costs several times more over a vocabulary."""
    return (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """(rows, vocab): how often each token occurs in each row's sequence (ids outside the vocabulary are not
    counted). One scatter over the rows, padded with an extra column that is dropped."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), max(width, 1)), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long).clamp_(0, vocab)
    ids = ids.to(device)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def adjust(
    logits: Tensor,
    params: Sequence[SamplingParams],
    answers: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    eos_ids: Iterable[int] = (),
) -> Tensor:
    """The logits with each row's `min_tokens`, `logit_bias` and penalties applied; `logits` itself (no copy)
    when no row asks for any. `answers`: each row's tokens generated so far."""
    rows, vocab = logits.shape
    dev = logits.device
    out = logits

    def own() -> Tensor:
        nonlocal out
        if out is logits:
            out = logits.clone()
        return out

    early = [i for i, p in enumerate(params) if len(answers[i]) < p.min_tokens]
    eos = [t for t in eos_ids if 0 <= t < vocab]
    if early and eos:
        ends = torch.tensor(early, device=dev).repeat_interleave(len(eos))
        idx = (ends, torch.tensor(eos, device=dev).repeat(len(early)))
        own().index_put_(idx, torch.tensor(-torch.inf, device=dev))
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if biased:
        who, tok, val = zip(*biased)
        idx = (torch.tensor(who, device=dev), torch.tensor(tok, device=dev))
        own().index_put_(idx, torch.tensor(val, dtype=out.dtype, device=dev), accumulate=True)
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:  # vLLM's (from CTRL): a seen token's positive logit is divided by the penalty, a negative one multiplied
        seen = token_counts([[*prompts[i], *answers[i]] for i in rep], vocab, dev) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=out.dtype, device=dev)[:, None]
        sub = own()[rep]
        out[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    pen = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if pen:  # OpenAI's: logit - count * frequency_penalty - (count > 0) * presence_penalty, over the answer so far
        counts = token_counts([answers[i] for i in pen], vocab, dev)
        freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=out.dtype, device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=out.dtype, device=dev)[:, None]
        own()[pen] -= counts * freq + (counts > 0).to(out.dtype) * pres
    return out


def draw(logits: Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator]) -> list[int | None]:
    """One sampled token per row (None where its distribution is not finite or empty): temperature, min_p, top_k
    and top_p per row, then the token where the row's uniform draw falls in its cumulative probabilities."""
    rows, vocab = logits.shape
    dev = logits.device

    def per_row(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=dev)[:, None]

    x = logits / per_row([p.temperature for p in params])
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(x, dim=-1)
        floor = per_row([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, -torch.inf)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        x, order = x.sort(dim=-1, descending=True, stable=True)  # stable: among equal logits the first, as argmax
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)[:, None]
        x = x.masked_fill(torch.arange(vocab, device=dev)[None, :] >= k, -torch.inf)
        probs = torch.softmax(x, dim=-1)
        # top_p keeps a token while the probability before it is below top_p: always the first one
        drop = probs.cumsum(dim=-1) - probs >= per_row([p.top_p for p in params])
        drop[:, 0] = False
        # back in vocabulary order: a row draws the same token whatever its batch-mates ask for
        probs = torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(drop, 0.0))
    else:
        probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in gens]).to(dev, cdf.dtype)
    tokens = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1).clamp_(max=vocab - 1).tolist()
    ok = (torch.isfinite(total) & (total > 0)).tolist()
    return [int(t) if good else None for t, good in zip(tokens, ok)]


def pick(
    raw: Tensor,
    logits: Tensor,
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator | None],
    finite: Sequence[bool],
) -> list[Pick | None]:
    """Each row's next token from its adjusted `logits` (greedy, or drawn with its generator), with its logprob
    from the `raw` logits where the row asks for them; None for a row whose raw logits are not finite."""
    tokens: list[int | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if finite[i] and (p.greedy or gens[i] is None)]
    drawn = [i for i, p in enumerate(params) if finite[i] and not (p.greedy or gens[i] is None)]
    if greedy:
        rows = logits[greedy] if len(greedy) < len(params) else logits
        best = rows.max(dim=-1).indices.tolist()  # max's index is the first maximum, as argmax's, and cheaper
        for i, t in zip(greedy, best):
            tokens[i] = int(t)
    if drawn:
        got = draw(logits[drawn], [params[i] for i in drawn], [gens[i] for i in drawn])  # type: ignore[misc]
        for i, t in zip(drawn, got):
            tokens[i] = t
    lps: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
    if wanted:
        chosen = [tokens[i] for i in wanted]
        for i, lp in zip(wanted, logprobs_of(raw[wanted], chosen, [params[i].logprobs or 0 for i in wanted])):  # type: ignore[arg-type]
            lps[i] = lp
    return [None if t is None else Pick(t, lps[i]) for i, t in enumerate(tokens)]


def logprobs_of(logits: Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """For each row of `logits` (a batch's rows, or one prompt's positions): the logprob of its target token and
    its `ks[i]` likeliest tokens, in float32 whatever the model computes in."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
    k = max(ks, default=0)
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(targets, chosen)]
    values, ids = lp.topk(k, dim=-1)
    top_v, top_i = values.tolist(), ids.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(top_i[r][: ks[r]], top_v[r][: ks[r]])))
        for r, (t, c) in enumerate(zip(targets, chosen))
    ]
