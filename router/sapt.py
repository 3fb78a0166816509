"""SAPT routing: a learned query projector over the base model's token embeddings, one key per skill.

Query: a pool of the prompt's token embeddings from the backbone's embedding table (a lookup, no
transformer layers; padding masked, so a decision never depends on the batch it arrived in): SAPT's
max-pool, or the mean (the default: a max over hundreds of tokens saturates to nearly the same vector), then
Linear(d→h) → Linear(h→d) → SiLU → LayerNorm(d). Attention over skills: softmax(key · q / (√d · T)).

Learning skill t (shared attentive learning): the new key and the projector are trained, earlier
keys stay frozen. Without an LM in the loop the new block's training signal is a cross-entropy that
sends skill t's inputs to block t (what the LM loss does to the attention while block t is the one
being fitted). Attentive reflection (ARM) keeps earlier skills in place: for each earlier skill τ,
λ · KL(ā_τ padded with zeros for newer blocks ‖ softmax(logits(replay inputs of τ))), where ā_τ is τ's
mean attention over its own held-out inputs, stored right after τ was learned.

State is functional: `learn` returns a new `SAPTState`; a live router is only changed when the new
skill is registered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

REPLAY_SOURCES = ("real", "pseudo")
POOLS = ("mean", "max")
PROJ_PREFIX = "sapt_projector."


@dataclass(frozen=True)
class SAPTSettings:
    hidden: int = 100  # projector bottleneck (SAPT: 100)
    temperature: float = 1.0  # logits = key · q / (sqrt(d) · temperature)
    lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = 300  # optimizer steps per learned skill (batches drawn with replacement): cheap, no LLM
    batch_size: int = 32
    arm_lambda: float = 4.0  # λ of attentive reflection
    pool: str = "mean"  # mean | max over the prompt's token embeddings
    replay: str = "real"  # real: the stored 2% samples | pseudo: inputs from the skill's generator LoRA
    max_tokens: int = 256  # prompt tokens pooled
    seed: int = 0
    # generative feature replay: each skill keeps a Gaussian (mean, top `feature_rank` principal directions,
    # an isotropic rest) of its pooled inputs, and attentive reflection also runs on `generated` draws from
    # it per earlier skill, not only on the few stored replay inputs, around which later skills' keys and
    # projector updates carve (the projector drifts). 0: off, reflection on the replay inputs alone.
    generated: int = 64
    feature_rank: int = 16

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_SOURCES:
            raise ValueError(f"sapt replay must be one of {', '.join(REPLAY_SOURCES)}, got {self.replay!r}")
        if self.pool not in POOLS:
            raise ValueError(f"sapt pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.temperature <= 0 or self.hidden <= 0 or self.steps < 0:
            raise ValueError("sapt temperature and hidden must be > 0, steps >= 0")
        if self.generated < 0 or self.feature_rank < 0:
            raise ValueError("sapt generated and feature_rank must be >= 0")


class TokenPooler:
    """Mean- or max-pool of the backbone's input token embeddings over the real (unpadded) tokens."""

    def __init__(self, weight: torch.Tensor, tokenizer: Any, max_tokens: int = 256, pool: str = "mean") -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        self.weight, self.tokenizer, self.max_tokens, self.pool = weight.detach().float(), tokenizer, max_tokens, pool
        self.dim = int(weight.shape[1])

    @classmethod
    def from_checkpoint(cls, path: Path | str, max_tokens: int = 256, pool: str = "mean") -> TokenPooler:
        """Read only the embedding table from a local HF checkpoint (no transformer layers loaded)."""
        from safetensors import safe_open
        from transformers import AutoTokenizer

        path = Path(path)
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                name = next((k for k in f.keys() if k.endswith("embed_tokens.weight")), None)
                if name is not None:
                    return cls(f.get_tensor(name), AutoTokenizer.from_pretrained(str(path)), max_tokens, pool)
        raise FileNotFoundError(f"no embed_tokens.weight in the safetensors files of {path}")

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        out = torch.empty(len(texts), self.dim)
        for i, text in enumerate(texts):  # one text at a time: no padding exists to leak into the max
            ids = self.tokenizer(text, add_special_tokens=False, truncation=True, max_length=self.max_tokens)[
                "input_ids"
            ]
            ids = ids or [self.tokenizer.eos_token_id]
            tokens = self.weight[torch.tensor(ids)]
            out[i] = tokens.amax(dim=0) if self.pool == "max" else tokens.mean(dim=0)
        return out


@dataclass(frozen=True)
class FeatureStats:
    """A Gaussian over a skill's pooled inputs: mean + factor · z + rest · ε (z ~ N(0, I_r), ε ~ N(0, I_d)),
    the factor its covariance's top principal directions scaled by √eigenvalue, `rest` the std of what is left."""

    mean: torch.Tensor  # (d,)
    factor: torch.Tensor  # (d, r)
    rest: float

    @staticmethod
    def fit(x: torch.Tensor, rank: int) -> FeatureStats:
        x = x.detach().float()
        mean = x.mean(0)
        if len(x) < 2:
            return FeatureStats(mean, torch.zeros(x.shape[1], 0), 0.0)
        centred = (x - mean) / float(np.sqrt(len(x) - 1))
        _, sv, vh = torch.linalg.svd(centred, full_matrices=False)
        r = min(rank, len(sv))
        leftover = float((sv[r:] ** 2).sum()) / max(1, x.shape[1] - r)  # per-dimension variance not in the factor
        return FeatureStats(mean, (vh[:r].T * sv[:r]).contiguous(), float(np.sqrt(leftover)))

    def sample(self, n: int, g: torch.Generator) -> torch.Tensor:
        z = torch.randn(n, self.factor.shape[1], generator=g)
        eps = torch.randn(n, len(self.mean), generator=g)
        return self.mean + z @ self.factor.T + self.rest * eps

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "sapt_feat_mean": self.mean.clone(),
            "sapt_feat_factor": self.factor.clone(),
            "sapt_feat_rest": torch.tensor([self.rest]),
        }

    @staticmethod
    def from_tensors(t: Mapping[str, torch.Tensor]) -> FeatureStats | None:
        if "sapt_feat_mean" not in t:
            return None  # stored before generative replay
        return FeatureStats(t["sapt_feat_mean"].float(), t["sapt_feat_factor"].float(), float(t["sapt_feat_rest"][0]))


class QueryProjector(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.SiLU(), nn.LayerNorm(dim))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(pooled)
        return out


@dataclass
class SAPTState:
    """The shared SAPT router: projector, one key per skill in learning order, stored mean attentions."""

    dim: int
    settings: SAPTSettings = field(default_factory=SAPTSettings)
    names: list[str] = field(default_factory=list)
    keys: torch.Tensor | None = None  # (n, d)
    mean_attention: dict[str, dict[str, float]] = field(default_factory=dict)  # ā_τ by block name
    projector: QueryProjector | None = None
    features: dict[str, FeatureStats] = field(default_factory=dict)  # generative replay, by block name

    def __post_init__(self) -> None:
        if self.projector is None:
            with torch.random.fork_rng():  # seeded init without moving the process's RNG (a server samples with it)
                torch.manual_seed(self.settings.seed)
                self.projector = QueryProjector(self.dim, self.settings.hidden)
        self.projector.eval()

    def logits(
        self, pooled: torch.Tensor, projector: nn.Module | None = None, keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        proj, k = projector or self.projector, self.keys if keys is None else keys
        assert proj is not None and k is not None
        return proj(pooled) @ k.T / (np.sqrt(self.dim) * self.settings.temperature)

    def attention(self, pooled: torch.Tensor) -> torch.Tensor:
        """(n, skills) softmax weights; empty when no skill is learned."""
        if self.keys is None:
            return torch.zeros(len(pooled), 0)
        with torch.no_grad():
            return self.logits(pooled).softmax(-1)

    def learn(
        self,
        name: str,
        train: torch.Tensor,
        held: torch.Tensor,
        replay: dict[str, torch.Tensor],
        check_stop: Callable[[], None] | None = None,
    ) -> SAPTState:
        """A new state with skill `name` added: its key and the projector trained, earlier keys frozen.

        train/held: pooled inputs of the new skill; replay: pooled replay inputs per earlier skill.
        check_stop: called before each step; it raises to stop (a trainer's cancel).
        """
        s = self.settings
        names, frozen = self.blocks_for(name)
        proj = copy.deepcopy(self.projector)
        assert proj is not None
        new_key = nn.Parameter(self.initial_key(proj, train, names).clone())
        t = len(names) - 1
        if t > 0 and s.steps > 0 and len(train):
            proj.train()
            opt = torch.optim.AdamW([*proj.parameters(), new_key], lr=s.lr, weight_decay=s.weight_decay)
            g = torch.Generator().manual_seed(s.seed)  # batch order
            draws = torch.Generator().manual_seed(s.seed + 1)  # generative replay
            label = torch.full((s.batch_size,), t, dtype=torch.long)
            for _ in range(s.steps):
                if check_stop is not None:
                    check_stop()
                idx = torch.randint(len(train), (min(s.batch_size, len(train)),), generator=g)
                keys = torch.cat([frozen, new_key[None]])
                loss = F.cross_entropy(self.logits(train[idx], proj, keys), label[: len(idx)])
                targets = self.arm_targets(names, replay, draws)
                if targets and s.arm_lambda > 0:
                    loss = loss + s.arm_lambda * self.arm_loss(targets, proj, keys)
                opt.zero_grad()
                loss.backward()
                opt.step()
            proj.eval()
        return self.with_skill(
            names,
            torch.cat([frozen, new_key.detach()[None]]),
            proj,
            held if len(held) else train,
            torch.cat([train, held]),
        )

    # --- pieces of `learn`, shared with training a LoRA block inside the attention mix ----------------
    def blocks_for(self, name: str) -> tuple[list[str], torch.Tensor]:
        """Block order while learning `name` (earlier skills, a same-named one dropped, then `name`) and the frozen earlier keys."""
        names = [n for n in self.names if n != name] + [name]
        old = [self.names.index(n) for n in names[:-1]]
        frozen = self.keys[old] if self.keys is not None and old else torch.zeros(0, self.dim)
        return names, frozen

    def initial_key(self, proj: nn.Module, train: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
        """The new key's start (`names`: the blocks, the new one last). The mean projected new input, less the
        mean projected draw from the earlier skills' Gaussians, at the earlier keys' mean norm: a key that
        already tells the new task from the old ones. The plain mean shares the direction every projected
        input has: at its norm it takes earlier skills' inputs before the first step, and the projector is
        wrenched from there. Seeded noise without inputs."""
        g = torch.Generator().manual_seed(self.settings.seed + len(names))
        if not len(train):
            return torch.randn(self.dim, generator=g)
        with torch.no_grad():
            mean = proj(train).mean(0)
            earlier = [self.features[n] for n in names[:-1] if n in self.features]
            if not earlier or self.settings.generated == 0 or self.keys is None:
                return mean
            draws = torch.cat([f.sample(self.settings.generated, g) for f in earlier])
            direction = mean - proj(draws).mean(0)
            norm = self.keys[[self.names.index(n) for n in names[:-1]]].norm(dim=1).mean()
            return direction / direction.norm().clamp_min(1e-12) * norm

    def arm_targets(
        self, names: Sequence[str], replay: Mapping[str, torch.Tensor], g: torch.Generator | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ā_τ over `names`, pooled inputs of τ: its replay inputs and, given a generator, `generated` fresh
        draws from its stored Gaussian) for every earlier skill τ that has ā and some inputs. Draw anew every
        step: a fixed set of draws is learned point by point instead of the region the skill's inputs live in."""
        out = []
        for n in names[:-1]:
            if n not in self.mean_attention:
                continue
            inputs = [replay[n]] if n in replay and len(replay[n]) else []
            stats = self.features.get(n)
            if g is not None and stats is not None and self.settings.generated > 0:
                inputs.append(stats.sample(self.settings.generated, g))
            if inputs:
                # ā_τ is kept by block name, so blocks newer than τ get zero mass (SAPT's zero padding)
                out.append((torch.tensor([self.mean_attention[n].get(m, 0.0) for m in names]), torch.cat(inputs)))
        return out

    def arm_loss(
        self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], proj: nn.Module, keys: torch.Tensor
    ) -> torch.Tensor:
        """Attentive reflection: mean over τ of KL(ā_τ ‖ softmax(logits(replay of τ))), before λ."""
        return torch.stack(
            [
                F.kl_div(self.logits(x, proj, keys).log_softmax(-1), a.expand(len(x), -1), reduction="batchmean")
                for a, x in targets
            ]
        ).mean()

    def with_skill(
        self,
        names: list[str],
        keys: torch.Tensor,
        proj: QueryProjector,
        inputs: torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> SAPTState:
        """The state after learning names[-1]: these keys and projector, its ā from `inputs` (held, else train),
        its Gaussian for generative replay from `features` (all its pooled inputs; default `inputs`)."""
        name = names[-1]
        out = SAPTState(self.dim, self.settings, names, keys, dict(self.mean_attention), proj, dict(self.features))
        out.mean_attention.pop(name, None)
        pool = inputs if features is None else features
        if len(pool):
            out.features[name] = FeatureStats.fit(pool, self.settings.feature_rank)
        else:
            out.features.pop(name, None)
        if len(inputs):
            mean = out.attention(inputs).mean(0)
            out.mean_attention[name] = {n: float(w) for n, w in zip(names, mean)}
        return out

    # --- storage: per skill its key and the projector as it was right after the skill was learned ----
    def learned(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """What a skill's folder keeps of this state: its router tensors, and its ā by block."""
        return self.skill_tensors(name), self.mean_attention[name]

    def skill_tensors(self, name: str) -> dict[str, torch.Tensor]:
        assert self.keys is not None
        out = {"sapt_key": self.keys[self.names.index(name)].clone(), "sapt_blocks": torch.tensor([len(self.names)])}
        stats = self.features.get(name)
        return {**out, **(stats.tensors() if stats is not None else {}), **self.projector_tensors()}

    def projector_tensors(self) -> dict[str, torch.Tensor]:
        assert self.projector is not None
        return {PROJ_PREFIX + k: v.detach().clone() for k, v in self.projector.state_dict().items()}

    @staticmethod
    def from_skills(
        dim: int,
        settings: SAPTSettings,
        skills: Sequence[tuple[str, dict[str, torch.Tensor]]],
        mean_attention: dict[str, dict[str, float]] | None = None,
    ) -> SAPTState:
        """Rebuild the shared state from stored skills; the projector is the one saved with the most blocks.

        Skills stored without SAPT tensors are left out (they were learned under another router mode).
        """
        state = SAPTState(dim, settings)
        usable = [(n, t) for n, t in skills if "sapt_key" in t]
        if not usable:
            return state
        newest = max(range(len(usable)), key=lambda i: (int(usable[i][1]["sapt_blocks"][0]), i))
        assert state.projector is not None
        state.projector.load_state_dict(
            {k[len(PROJ_PREFIX) :]: v.float() for k, v in usable[newest][1].items() if k.startswith(PROJ_PREFIX)}
        )
        state.names = [n for n, _ in usable]
        state.keys = torch.stack([t["sapt_key"].float() for _, t in usable])
        state.mean_attention = {n: dict(a) for n, a in (mean_attention or {}).items() if n in state.names}
        state.features = {n: f for n, t in usable if (f := FeatureStats.from_tensors(t)) is not None}
        return state
