"""Training hyperparameters: defaults that finish on 2 CPU cores, every one settable per upload."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from skillpool.runtime.dtype import DTYPES

METHODS = ("isolated", "sapt", "kif")  # each name has its class in trainer/methods (which checks a job's method)
DEFAULT_METHOD = "isolated"
# the method an imported adapter's skill and job say it was made by (trained elsewhere: no method of ours ran)
IMPORTED = "imported"
KIF_STARTS = ("similar", "latest")  # TrainConfig.kif_start, see trainer/methods/kif.py
CHECKPOINTING = {"auto": None, "on": True, "off": False}  # TrainConfig.gradient_checkpointing → Schedule's
# TrainConfig.prompt_variant_copies' bound: one per kind of wording but the first's (prompt_variants.KINDS)
MAX_VARIANT_COPIES = 4


# fields added after runs were recorded, each with the value that trains as a config without it did: a recorded
# config lacking one is read as having it (eval continual's --resume and --reference compare recorded configs;
# a Redis job's payload is one, so a job queued before an upgrade trains as it was queued)
ADDED_SINCE: dict[str, Any] = {"prompt_variant_copies": 1, "dtype": "float32"}


# the quality gate's settings, each with the way it loosens the gate (+1: a higher value, -1: a lower one). A looser
# value than the default lets through a skill the gate would stop (quality_max_drop guards earlier skills, other
# users' too; eval_fraction 0 holds no row out and skips the held-out check), so it takes the role `force` takes
GATE_FIELDS: dict[str, int] = {
    "quality_min_gain": -1,
    "quality_z": -1,
    "quality_max_drop": +1,
    "eval_fraction": -1,
    "max_eval_examples": -1,
}


def as_recorded_now(raw: Any) -> Any:
    """A config dict recorded by an earlier run, with the fields added since filled as it trained."""
    return {**ADDED_SINCE, **raw} if isinstance(raw, dict) else raw


class ConfigError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 3.0
    learning_rate: float = 1e-3
    batch_size: int = 8
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    max_seq_len: int = 512
    # recompute each decoder layer's activations in backward instead of keeping them. "auto": on the CPU for
    # the steps whose padded batch holds at least 2,048 tokens (Schedule.checkpoint_tokens), off on a GPU:
    # smaller batches fit without it and pay the most for it (docs/design/decisions.md#gradient-checkpointing-auto)
    gradient_checkpointing: str = "auto"
    # what the forward and backward multiply in (the loss, the LoRA weights and AdamW's state stay float32):
    # "auto" is the trainer's --dtype, itself bf16 on a CPU with bf16 arithmetic (runtime/dtype.py)
    dtype: str = "auto"
    warmup_ratio: float = 0.06
    weight_decay: float = 0.0
    eval_fraction: float = 0.1  # held-out split for the skill's eval result
    max_eval_examples: int = 50
    replay_fraction: float = 0.02  # stored for later replay / memory buffers
    probe_size: int = 20  # held-out prompts kept to re-check the skill later
    seed: int = 0
    # share of the training rows also shown in another wording (input alone, instruction as a system message or
    # after the input, a rewording keeping the label set: trainer/prompt_variants.py), so a skill answers users who
    # do not copy its template; 0.0 trains on the rows as uploaded only (docs/skills.md#prompt-variants)
    prompt_variants: float = 1.0
    # True: each such variant is one more row beside its uploaded row (the uploaded wording keeps all its
    # training; the steps grow by the share); False: it replaces the row (same steps, measured to cost accuracy)
    prompt_variants_added: bool = True
    # with added variants: how many wordings of different kinds follow each chosen row (each one more row); 2
    # met the paraphrase-gap criterion routed on all 12 Long Sequence tasks, 1 did not
    # (docs/benchmarks.md#answers-under-paraphrase)
    prompt_variant_copies: int = 2
    # quality gate (trainer/quality.py)
    quality_min_gain: float = 0.05  # held-out score must beat max(base model, most frequent answer) by this
    quality_z: float = 1.645  # ... and the gain's lower bound (mean - z * standard error) must be > 0 (0 disables)
    quality_max_drop: float = 0.1  # an earlier skill's routed probe score may drop by at most this
    # method kif (trainer/methods/kif.py): Recurrent-KIF
    kif_inner_steps: int = 8  # Q inner steps on the new task per outer step on the memory buffer
    # share of each tensor's coordinates kept by each importance mask; 1.0 keeps the whole update: a block here
    # is its task's own and earlier blocks are frozen, so masking only cuts what the new task learns
    kif_top_q: float = 1.0
    kif_ema_in: float = 0.55  # α: EMA of the new task's importance
    kif_ema_hist: float = 0.55  # β: EMA of the memory's importance
    kif_init_blocks: int = 3  # the new block starts from at most this many similar existing blocks (0: fresh)
    kif_start_probe: int = 16  # new-task rows that score the candidate starts (0: always the blocks' mix)
    kif_start_margin: float = 0.02  # a start from blocks must beat fresh's probe loss by this share
    # > 0: the probe's pick and fresh each train this many cycles, then the lower held-out loss (by the margin)
    # trains on. Off by default: it also kept fresh a task a block's start served better
    # (docs/benchmarks.md#continual-learning)
    kif_start_trial: int = 0
    # where the block starts: "similar" (the probe's pick among the nearest blocks, their mix and fresh) or "latest"
    # (the newest earlier block of the task's answer kind, taken whole, no probe). "latest" chains the blocks the
    # way one LoRA trained in turn carries its transfer, with every step frozen as its task's own block. Off by
    # default: it hardly moved the sequences' average score (docs/skills.md#methods)
    kif_start: str = "similar"
    # method sapt (trainer/methods/sapt.py)
    sapt_route_weight: float = 1.0  # cross-entropy sending the task's inputs to its own block, beside the LM loss

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> TrainConfig:
        raw = dict(raw or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"config.{unknown[0]}", f"unknown hyperparameter (known: {', '.join(known)})")
        base = asdict(cls())
        for key, value in raw.items():
            want = type(base[key])
            if key == "gradient_checkpointing" and isinstance(value, bool):  # as transformers spells it
                value = "on" if value else "off"
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if want is list:
                if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
                    raise ConfigError(f"config.{key}", "must be a non-empty list of module names")
            elif not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise ConfigError(f"config.{key}", f"must be a {want.__name__}, got {value!r}")
            elif want is float and not math.isfinite(value):  # json.loads accepts NaN and Infinity
                raise ConfigError(f"config.{key}", f"must be a finite number, got {value!r}")
            base[key] = value
        if base["prompt_variants_added"] is False and "prompt_variant_copies" not in raw:
            base["prompt_variant_copies"] = 1  # replaced rows take one wording; 2 is only the added default
        cfg = cls(**base)
        cfg._check()
        return cfg

    def _check(self) -> None:
        positive = ("epochs", "learning_rate", "batch_size", "rank", "alpha", "max_seq_len", "max_eval_examples")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.{name}", "must be > 0")
        for name in ("dropout", "warmup_ratio", "eval_fraction", "replay_fraction", "kif_start_margin"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"config.{name}", "must be in [0, 1)")
        for name in (
            "weight_decay",
            "probe_size",
            "quality_z",
            "quality_max_drop",
            "kif_init_blocks",
            "kif_start_probe",
            "kif_start_trial",
            "sapt_route_weight",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name}", "must be >= 0")
        if not 0 <= self.prompt_variants <= 1:
            raise ConfigError("config.prompt_variants", "must be in [0, 1]")
        if not 1 <= self.prompt_variant_copies <= MAX_VARIANT_COPIES or (
            self.prompt_variant_copies > 1 and not self.prompt_variants_added
        ):
            raise ConfigError(
                "config.prompt_variant_copies",
                f"must be in [1, {MAX_VARIANT_COPIES}], and 1 unless prompt_variants_added",
            )
        if not -1 <= self.quality_min_gain <= 1:
            raise ConfigError("config.quality_min_gain", "must be in [-1, 1]")
        if self.kif_inner_steps < 1:
            raise ConfigError("config.kif_inner_steps", "must be >= 1")
        if not 0 < self.kif_top_q <= 1:
            raise ConfigError("config.kif_top_q", "must be in (0, 1]")
        for name in ("kif_ema_in", "kif_ema_hist"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"config.{name}", "must be in [0, 1)")
        if self.epochs > 100 or self.rank > 256 or self.batch_size > 512:
            raise ConfigError("config", "epochs <= 100, rank <= 256 and batch_size <= 512")
        upper = {"learning_rate": 1.0, "alpha": 1e4, "max_seq_len": 32768, "max_eval_examples": 100_000}
        upper |= {"probe_size": 10_000, "quality_z": 10.0, "kif_init_blocks": 64, "sapt_route_weight": 1e3}
        upper |= {"quality_max_drop": 1.0, "weight_decay": 10.0, "kif_inner_steps": 1000}
        upper |= {"kif_start_probe": 10_000, "kif_start_trial": 1000}
        for name, most in upper.items():
            if getattr(self, name) > most:
                raise ConfigError(f"config.{name}", f"must be <= {most:g}")
        if self.kif_start not in KIF_STARTS:
            raise ConfigError("config.kif_start", f"must be one of {', '.join(KIF_STARTS)}, got {self.kif_start!r}")
        if self.gradient_checkpointing not in CHECKPOINTING:
            raise ConfigError(
                "config.gradient_checkpointing",
                f"must be one of {', '.join(CHECKPOINTING)}, got {self.gradient_checkpointing!r}",
            )
        if self.dtype not in DTYPES:
            raise ConfigError("config.dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes no more
            raise ConfigError("config.seed", "must be in [0, 2**63)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def gate_loosened(self) -> list[str]:
        """The quality gate's fields (GATE_FIELDS) set looser than their defaults, in GATE_FIELDS' order."""
        default = TrainConfig()
        return [n for n, way in GATE_FIELDS.items() if (getattr(self, n) - getattr(default, n)) * way > 0]
