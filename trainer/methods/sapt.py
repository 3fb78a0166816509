"""Method sapt, SAPT attentive learning: train a new LoRA block inside the attention mix of the frozen earlier
blocks. It needs the router in sapt mode: serving then mixes blocks with that same attention.

While block t trains, every target Linear computes y = W x + Σ_i w_i · s_i · B_i A_i x over blocks 0..t,
with w = softmax(key · q / (√d · T)) from the query projector over the pooled prompt embeddings: the
same mixed layer serving applies (lora.mixed_layer), so forward transfer from earlier blocks is
learned through it. Trainable: block t, its key and (a copy of) the projector; earlier blocks and keys
stay frozen. Loss = answer loss of the mixed model + route_weight · CE(logits, t) (the router signal
`SAPTState.learn` uses alone) + λ · ARM (earlier skills' attention kept in place, as in `learn`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, save_peft_adapter
from skillpool.lora.training_mix import WeightedMix, weighted_mix
from skillpool.router.sapt import QueryProjector, SAPTState, TokenPooler

from ..config import TrainConfig
from ..loop import Method, Progress, Schedule, TrainLoop, answer_loss
from ..lora_train import encode_example, pad_id, schedule_of
from ..records import Example
from .base import BlockJob, TrainedBlock, TrainingMethod


@dataclass(frozen=True)
class AttentiveResult:
    adapter: LoRAAdapter  # the new block (float32 on cpu)
    state: SAPTState  # the router state with the new skill added (new key, trained projector, its ā)


def target_paths(model: nn.Module, target_modules: Sequence[str]) -> list[str]:
    """Every Linear of the model whose attribute name is in target_modules."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rpartition(".")[2] in target_modules]


def new_block(model: nn.Module, cfg: TrainConfig) -> LoRAAdapter:
    """A fresh trainable block as PEFT starts one (A kaiming-uniform a=√5, B zero), float32 Parameters on the
    model's device; seeded by its own generator so the process's RNG (a server samples with it) is untouched."""
    paths = target_paths(model, cfg.target_modules)
    if not paths:
        raise ValueError(f"no Linear named {list(cfg.target_modules)} in the model")
    g = torch.Generator().manual_seed(cfg.seed)
    modules = {}
    for path in paths:
        base = model.get_submodule(path)
        assert isinstance(base, nn.Linear)
        A = nn.init.kaiming_uniform_(torch.empty(cfg.rank, base.in_features), a=math.sqrt(5), generator=g)
        B = torch.zeros(base.out_features, cfg.rank)
        device = base.weight.device
        modules[path] = LoRAFactors(
            A=nn.Parameter(A.to(device)), B=nn.Parameter(B.to(device)), scaling=cfg.alpha / cfg.rank
        )
    return LoRAAdapter(modules=modules)


class _Unwrapped(nn.Module):
    """`answer_loss` takes a PEFT model and asks it for the base model: here the model with the mix installed."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def get_base_model(self) -> nn.Module:
        return self.model


def train_attentive(
    model: nn.Module,
    tokenizer: Any,
    name: str,
    train: Sequence[Example],
    held_texts: Sequence[str],
    cfg: TrainConfig,
    state: SAPTState,
    pooler: TokenPooler,
    old_blocks: Mapping[str, LoRAAdapter],
    replay: Mapping[str, Sequence[str]],
    *,
    route_weight: float = 1.0,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> AttentiveResult:
    """Train skill `name`'s block inside the mix of the earlier blocks (state.names order), with its key and
    the projector. `model` (a plain HF causal LM) is frozen and given back as it came; `state` is not changed."""
    if not train:
        raise ValueError("nothing to train on: no examples")
    names, frozen_keys = state.blocks_for(name)
    missing = [n for n in names[:-1] if n not in old_blocks]
    if missing:
        raise KeyError(f"no LoRA block given for earlier skill(s) {missing}")
    device = next(model.parameters()).device
    # frozen blocks as float32 copies on the model's device (the caller's tensors are never touched)
    frozen = [
        LoRAAdapter(
            {
                p: LoRAFactors(
                    f.A.detach().to(device, torch.float32), f.B.detach().to(device, torch.float32), f.scaling
                )
                for p, f in old_blocks[n].modules.items()
            }
        )
        for n in names[:-1]
    ]
    block = new_block(model, cfg)
    proj = copy.deepcopy(state.projector)
    assert proj is not None
    pooled = pooler([str(ex["route_text"]) for ex in train])  # once per example: pooling is deterministic
    # a state that already holds `name` (the router-only stage placed its key) warm-starts the key from there
    start = (
        state.keys[state.names.index(name)]
        if name in state.names and state.keys is not None
        else state.initial_key(proj, pooled, names)
    )
    key = nn.Parameter(start.detach().clone())
    replay_pooled = {n: pooler(list(replay[n])) for n in names[:-1] if n in replay and len(replay[n])}
    encoded = [encode_example(tokenizer, ex, cfg.max_seq_len) for ex in train]

    grad_flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    model.requires_grad_(False)
    try:
        with weighted_mix(model, [*frozen, block], dropout=cfg.dropout) as mix:
            method = SAPT(model, mix, pooled, state, names, frozen_keys, key, proj, block, replay_pooled, route_weight)
            TrainLoop(method, encoded, pad_id(tokenizer), schedule_of(cfg), on_progress, should_stop).run()
    finally:
        model.train(was_training)
        for n, p in model.named_parameters():
            p.requires_grad_(grad_flags[n])

    adapter = LoRAAdapter(
        {
            p: LoRAFactors(f.A.detach().float().cpu().clone(), f.B.detach().float().cpu().clone(), f.scaling)
            for p, f in block.modules.items()
        }
    )
    held = pooler(list(held_texts)) if held_texts else pooled
    new_state = state.with_skill(
        names,
        torch.cat([frozen_keys, key.detach()[None]]),
        proj,
        held,
        torch.cat([pooled, held]) if held_texts else pooled,
    )
    return AttentiveResult(adapter=adapter, state=new_state)


class SAPT(Method):
    """SAPT's hooks on the loop: the mix's attention weights from the projector and keys for each batch (t > 0;
    a single block has weight 1), the answer loss of the mixed model + route CE + λ · ARM, and the router's
    parameters as a second group (clipped apart: the router's CE must not shrink the block's step)."""

    def __init__(
        self,
        model: nn.Module,
        mix: WeightedMix,
        pooled: Tensor,
        state: SAPTState,
        names: list[str],
        frozen_keys: Tensor,
        key: nn.Parameter,
        proj: QueryProjector,
        block: LoRAAdapter,
        replay_pooled: Mapping[str, Tensor],
        route_weight: float,
    ) -> None:
        super().__init__(_Unwrapped(model))
        self.mix, self.pooled, self.state, self.frozen_keys, self.key = mix, pooled, state, frozen_keys, key
        self.proj, self.block, self.route_weight = proj, block, route_weight
        self.t = len(names) - 1  # the new block's index in the mix
        self.names, self.replay_pooled = names, replay_pooled
        self.draws = torch.Generator().manual_seed(state.settings.seed + 1)  # generative replay, fresh each step

    def param_groups(self, schedule: Schedule) -> list[dict[str, Any]]:
        lora = [p for f in self.block.modules.values() for p in (f.A, f.B)]
        groups: list[dict[str, Any]] = [
            {"params": lora, "lr": schedule.learning_rate, "weight_decay": schedule.weight_decay}
        ]
        # one block: the softmax is constant, so key and projector get no signal (as in `learn`) and stay out
        if self.t > 0:
            s = self.state.settings
            groups.append({"params": [*self.proj.parameters(), self.key], "lr": s.lr, "weight_decay": s.weight_decay})
        return groups

    def start(self) -> None:
        self.model.train()
        if self.t > 0:
            self.proj.train()

    def finish(self) -> None:  # the model's own mode is train_attentive's to give back
        self.proj.eval()

    def loss(self, batch: dict[str, Tensor], ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        if self.t == 0:  # a single block: weight 1
            self.mix.set_weights(torch.ones(len(ids), 1))
            answer = answer_loss(self.model, batch)
            return answer, answer
        keys = torch.cat([self.frozen_keys, self.key[None]])
        logits = self.state.logits(self.pooled[ids], self.proj, keys)
        self.mix.set_weights(logits.softmax(-1))
        answer = answer_loss(self.model, batch)  # reported alone: comparable with isolated training's
        loss = answer + self.route_weight * F.cross_entropy(logits, torch.full((len(ids),), self.t))
        s = self.state.settings
        targets = self.state.arm_targets(self.names, self.replay_pooled, self.draws)
        if targets and s.arm_lambda > 0:
            loss = loss + s.arm_lambda * self.state.arm_loss(targets, self.proj, keys)
        return loss, answer

    def after_backward(self, loop: TrainLoop) -> None:
        self.mix.set_weights(None)  # drop the graph's last reference before the next batch


class SAPTMethod(TrainingMethod):
    name = "sapt"
    learns_router_key = True

    @classmethod
    def router_error(cls, router_mode: str) -> str | None:
        if router_mode == "sapt":
            return None
        return (
            f"method sapt trains the block inside the sapt router's attention, but this server routes with "
            f"{router_mode!r}: start the server (and workers) with --router-mode sapt"
        )

    def train(self, job: BlockJob) -> TrainedBlock:
        name, cfg = job.name, job.cfg
        train_texts, held_texts = [e["route_text"] for e in job.train], [e["route_text"] for e in job.held]
        replay_texts, pool = job.replay_inputs(), job.router.pooler
        assert pool is not None
        # router-only stage first (SAPT's settings.steps of CE + ARM): the LM steps alone are too few to place the key
        warm = job.router.sapt_state().learn(
            name,
            pool(train_texts),
            pool(held_texts),
            {n: pool(t) for n, t in replay_texts.items() if t},
            job.check,
        )
        result = train_attentive(
            job.model,
            job.tok,
            name,
            job.train,
            held_texts,
            cfg,
            warm,
            pool,
            {n: job.record(n).adapter() for n in warm.names if n != name},
            replay_texts,
            route_weight=cfg.sapt_route_weight,
            on_progress=job.on_progress,
            should_stop=job.should_stop,
        )
        save_peft_adapter(result.adapter, job.folder, job.base_model_id, cfg.alpha, cfg.target_modules, cfg.dropout)
        return TrainedBlock(
            model=job.model,  # train_attentive gives it back as it came
            router_tensors=result.state.skill_tensors(name),
            attention=result.state.mean_attention[name],
        )
