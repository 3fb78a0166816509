"""What a PEFT LoRA brought from outside must be to serve as a skill of this base model, checked before anything is
stored: a plain LoRA (no DoRA, bias, modules_to_save, or an init that changes the base weights), its config and
tensors in agreement, every block on a layer the base model has with that layer's sizes, on a supported module,
one rank within the server's limit and one scaling, every weight finite.

A `CheckedAdapter` is written back as our own PEFT files (adapter.save_peft_adapter: the tensors as they came, r,
lora_alpha and use_rslora as the adapter had them), so every stored skill, trained or imported, is read one way,
and what `GET /v1/models/{model}/adapter` exports is what PEFT and vLLM load with the same delta.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from .adapter import PEFT_CONFIG, PEFT_WEIGHTS, AdapterRejected, LoRAAdapter, LoRAFactors, save_peft_adapter

# the decoder layers' projections: what both engines apply per row (vLLM's embedding and logits LoRA take no mix)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 256  # the largest rank skillpool trains (TrainConfig.rank) and imports
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])\.weight$")
# init_lora_weights values that leave the base weights alone (vLLM's list); pissa, olora, corda and loftq change them
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# config fields that change what a LoRA computes beyond B @ A, as (field, what it is): any truthy value is refused
_UNSERVED = (
    ("use_dora", "DoRA (a magnitude vector beside the LoRA blocks)"),
    ("modules_to_save", "modules_to_save (full copies of base layers)"),
    ("lora_bias", "a bias on lora_B"),
    ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
    ("layer_replication", "layer_replication"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("trainable_token_indices", "trainable tokens (new embedding rows)"),
    ("target_parameters", "LoRA on parameters (target_parameters)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
    ("velora_config", "VeLoRA (velora_config)"),
)


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that passed every check: its blocks, and the r, lora_alpha and use_rslora its config says."""

    adapter: LoRAAdapter
    rank: int
    alpha: float
    use_rslora: bool
    source_base: str | None  # the base model its config names (base_model_name_or_path), for the record

    def save(self, folder: Path, base_model_id: str) -> None:
        """The adapter as our own PEFT files in `folder`, naming `base_model_id` as its base."""
        targets = sorted({p.rsplit(".", 1)[-1] for p in self.adapter.modules})
        save_peft_adapter(self.adapter, folder, base_model_id, self.alpha, targets, use_rslora=self.use_rslora)

    def summary(self) -> dict[str, Any]:
        """What a skill's meta records of it."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "modules": sorted({p.rsplit(".", 1)[-1] for p in self.adapter.modules}),
            "blocks": len(self.adapter.modules),
            "source_base_model": self.source_base,
        }


def _refuse(code: str, message: str) -> AdapterRejected:
    return AdapterRejected(code, message)


def _config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _refuse("invalid_adapter_config", f"{PEFT_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse("invalid_adapter_config", f"{PEFT_CONFIG} must hold a JSON object")
    return config


def _known_fields() -> frozenset[str]:
    from peft import LoraConfig

    return frozenset(f.name for f in fields(LoraConfig))


def _check_config(config: dict[str, Any]) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of a config that describes a plain LoRA; AdapterRejected naming the field."""
    where = PEFT_CONFIG
    if config.get("peft_type") != "LORA":
        raise _refuse(
            "adapter_not_lora", f"{where}: peft_type is {config.get('peft_type')!r}; only LORA adapters serve"
        )
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise _refuse(
            "adapter_not_lora", f"{where}: task_type is {config['task_type']!r}; skills are CAUSAL_LM adapters"
        )
    for name, what in _UNSERVED:
        if config.get(name):
            raise _refuse("adapter_unsupported_feature", f"{where}: {name} is set: {what} is not served")
    if config.get("bias", "none") not in (None, "none"):
        raise _refuse("adapter_unsupported_feature", f"{where}: bias is {config['bias']!r}; only bias 'none' is served")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        raise _refuse(
            "adapter_unsupported_feature",
            f"{where}: init_lora_weights {init!r} changes the base model's weights when loaded; convert it to a plain "
            "LoRA first (PEFT's path_initial_model_for_weight_conversion)",
        )
    unknown = sorted(k for k, v in config.items() if k not in _known_fields() and v not in (None, False, [], {}, ""))
    if unknown:
        raise _refuse("adapter_unsupported_feature", f"{where}: unknown field {unknown[0]!r}: not read, so refused")
    r, alpha, rslora = config.get("r"), config.get("lora_alpha", config.get("r")), config.get("use_rslora", False)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse("invalid_adapter_config", f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise _refuse("invalid_adapter_config", f"{where}: lora_alpha must be a finite number > 0, got {alpha!r}")
    if not isinstance(rslora, bool):
        raise _refuse("invalid_adapter_config", f"{where}: use_rslora must be true or false, got {rslora!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise _refuse("invalid_adapter_config", f"{where}: {name} must be an object")
    return r, float(alpha), rslora


def _pattern_value(pattern: Mapping[str, Any], path: str, default: Any) -> Any:
    """PEFT's own rule for rank_pattern and alpha_pattern: the first key that matches the module path's end."""
    from peft.utils.other import get_pattern_key

    key = get_pattern_key(list(pattern), path)
    return pattern.get(key, default)


def _tensors(raw: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError) as e:  # never a pickle: safetensors only parses its own format
        raise _refuse("invalid_adapter_weights", f"{PEFT_WEIGHTS} is not a safetensors file ({e})") from None


def _blocks(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """((A, B) by module path, the keys that are no LoRA block's); AdapterRejected naming a block without its pair."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            others.append(key)  # refused once the blocks are checked: those say more (another model, lm_head)
            continue
        if t.dtype not in WEIGHT_DTYPES or t.dim() != 2:
            raise _refuse(
                "invalid_adapter_weights",
                f"{PEFT_WEIGHTS}: tensor {key!r} is {t.dtype} of shape {tuple(t.shape)}; LoRA blocks are 2-D float32, "
                "float16 or bfloat16",
            )
        found.setdefault(m["path"], {})[m["part"]] = t
    out = {}
    for path, pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise _refuse("invalid_adapter_weights", f"{PEFT_WEIGHTS}: module {path} has no {missing} weight")
        out[path] = (pair["A"], pair["B"])
    return out, sorted(others)


def check_peft_files(
    files: Mapping[str, bytes],
    linears: Mapping[str, tuple[int, int]],
    max_rank: int,
    base_name: str = "the base model",
    rank_limit: str = "",
) -> CheckedAdapter:
    """Check a PEFT LoRA's two files against the base model's Linear layers (`linears`: path -> (in, out)); the first
    problem is an AdapterRejected whose message names it. `rank_limit` says where `max_rank` comes from."""
    config = _config(files[PEFT_CONFIG])
    r, alpha, rslora = _check_config(config)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    blocks, others = _blocks(_tensors(files[PEFT_WEIGHTS]))
    modules: dict[str, LoRAFactors] = {}
    scalings: dict[str, float] = {}
    for path, (A, B) in blocks.items():
        if path not in linears:
            raise _refuse(
                "adapter_base_mismatch",
                f"module {path} is not a layer of {base_name}: an adapter for another architecture or model",
            )
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_MODULES:
            raise _refuse(
                "adapter_unsupported_module",
                f"module {path}: LoRA on {leaf} is not served (supported: {', '.join(SUPPORTED_MODULES)})",
            )
        n_in, n_out = linears[path]
        if A.shape[1] != n_in or B.shape[0] != n_out or A.shape[0] != B.shape[1]:
            raise _refuse(
                "adapter_base_mismatch",
                f"module {path}: the adapter's blocks are lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                f"{base_name}'s layer maps {n_in} to {n_out} features: an adapter for another base model",
            )
        rank = int(A.shape[0])
        want = _pattern_value(rank_pattern, path, r)
        if rank != want:
            raise _refuse(
                "invalid_adapter_weights",
                f"module {path}: its blocks have rank {rank}, {PEFT_CONFIG} says r {want}",
            )
        if rank > max_rank:
            raise _refuse(
                "adapter_rank_too_large",
                f"module {path}: rank {rank} is above this server's limit of {max_rank}{rank_limit}",
            )
        for part, t in (("lora_A", A), ("lora_B", B)):
            if not bool(torch.isfinite(t).all()):
                raise _refuse(
                    "adapter_not_finite",
                    f"{PEFT_WEIGHTS}: tensor base_model.model.{path}.{part}.weight holds NaN or Inf",
                )
        a = float(_pattern_value(alpha_pattern, path, alpha))
        scalings[path] = a / math.sqrt(rank) if rslora else a / rank
        modules[path] = LoRAFactors(A=A, B=B, scaling=scalings[path])
    if others:
        raise _refuse(
            "adapter_unsupported_feature",
            f"{PEFT_WEIGHTS}: tensor {others[0]!r} is not a LoRA block (base_model.model.<module>.lora_A.weight or "
            "lora_B.weight)",
        )
    if not modules:
        raise _refuse("invalid_adapter_weights", f"{PEFT_WEIGHTS} holds no LoRA weights")
    if config.get("fan_in_fan_out"):  # after the layers: an adapter for Conv1D models is named as another model's
        raise _refuse(
            "adapter_unsupported_feature",
            f"{PEFT_CONFIG}: fan_in_fan_out is set (blocks for Conv1D layers); {base_name}'s layers are Linear",
        )
    ranks = {f.rank for f in modules.values()}
    if len(ranks) > 1:
        raise _refuse(
            "adapter_mixed_ranks",
            f"{PEFT_CONFIG}: rank_pattern gives the modules ranks {sorted(ranks)}; one rank per adapter is served",
        )
    first = next(iter(scalings.values()))
    if any(not math.isclose(s, first, rel_tol=1e-9) for s in scalings.values()):
        raise _refuse(
            "adapter_mixed_ranks", f"{PEFT_CONFIG}: alpha_pattern gives the modules different scalings; one is served"
        )
    (rank,) = ranks
    # the one alpha that gives every block its scaling (alpha_pattern's, where it set the same value everywhere)
    alpha = first * (math.sqrt(rank) if rslora else rank) if alpha_pattern else alpha
    source = config.get("base_model_name_or_path")
    return CheckedAdapter(LoRAAdapter(modules), rank, alpha, rslora, source if isinstance(source, str) else None)
