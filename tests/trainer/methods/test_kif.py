"""Recurrent-KIF on a tiny model with real PEFT: the SVD seeding of a new block from existing blocks, the
masked fusion of each cycle, and that replaying a memory buffer this way protects the earlier task."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.loop import Cancelled, Progress, Schedule, TrainLoop, answer_loss, collate
from skillpool.trainer.lora_train import add_lora, encode_example, fit, pad_id
from skillpool.trainer.methods.kif import KIF, KIFSettings, StartTrial, train_kif
from skillpool.trainer.methods.kif_start import choose_start, init_from_blocks, probe_loss

TARGETS = ("q_proj", "v_proj")
Encoded = tuple[list[int], list[int]]

TASK_A = [("colour?", "red"), ("fruit?", "apple"), ("pet?", "cat"), ("day?", "monday")]
TASK_B = [("city?", "paris"), ("metal?", "iron"), ("tree?", "oak"), ("month?", "june")]
TASK_C = [("car?", "ford"), ("sea?", "pacific"), ("bird?", "owl"), ("note?", "do")]


@pytest.fixture(scope="module")
def tok(tiny_base):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_base.path))


def encode(tok, pairs: list[tuple[str, str]]) -> list[Encoded]:  # type: ignore[no-untyped-def]
    return [encode_example(tok, {"messages": [{"role": "user", "content": q}], "answer": a}, 64) for q, a in pairs]


def peft_model(tiny_base, rank: int, seed: int = 0) -> nn.Module:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base.path), dtype=torch.float32)
    return add_lora(model, rank, 2.0 * rank, 0.0, TARGETS, seed)  # no dropout: runs repeat exactly


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name.removeprefix("base_model.model."): mod
        for name, mod in model.named_modules()
        if isinstance(getattr(mod, "lora_A", None), nn.ModuleDict) and "default" in mod.lora_A
    }


def block_of(model: nn.Module) -> LoRAAdapter:
    """The trained block as the store would hold it."""
    return LoRAAdapter(
        modules={
            path: LoRAFactors(
                A=mod.lora_A["default"].weight.detach().clone(),
                B=mod.lora_B["default"].weight.detach().clone(),
                scaling=float(mod.scaling["default"]),
            )
            for path, mod in lora_layers(model).items()
        }
    )


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def random_adapter(model: nn.Module, rank: int, scaling: float, seed: int, skip: tuple[str, ...] = ()) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for path, mod in lora_layers(model).items():
        if path not in skip:
            base = mod.base_layer
            A = torch.randn(rank, base.in_features, generator=g) * 0.3
            modules[path] = LoRAFactors(A=A, B=torch.randn(base.out_features, rank, generator=g) * 0.3, scaling=scaling)
    return LoRAAdapter(modules=modules)


def new_delta(mod: nn.Module) -> torch.Tensor:
    return float(mod.scaling["default"]) * mod.lora_B["default"].weight.detach() @ mod.lora_A["default"].weight.detach()


def one_cycle(model: nn.Module, tok, settings: KIFSettings, on_progress) -> None:  # type: ignore[no-untyped-def]
    """Task B's 4 examples at batch size 2 with task A as memory: with inner_steps=2, exactly one cycle of two
    task steps, then one outer step."""
    schedule = Schedule(epochs=1.0, batch_size=2, learning_rate=1e-2, seed=0)
    train_kif(model, encode(tok, TASK_B), encode(tok, TASK_A), pad_id(tok), schedule, settings, on_progress=on_progress)


def test_init_from_blocks_is_the_best_low_rank_fit_of_the_weighted_mix(tiny_base) -> None:  # type: ignore[no-untyped-def]
    model = peft_model(tiny_base, rank=4)
    paths = sorted(lora_layers(model))
    assert len(paths) == 4  # q_proj and v_proj in each of the 2 layers
    lacking = paths[-1]  # block 2 lacks this module: its weight still counts in the normalization
    b1 = random_adapter(model, rank=2, scaling=1.5, seed=1)
    b2 = random_adapter(model, rank=2, scaling=0.5, seed=2, skip=(lacking,))

    assert init_from_blocks(model, [(b1, 3.0), (b2, 1.0)]) == 4
    for path, mod in lora_layers(model).items():
        want = 0.75 * b1.modules[path].delta()
        if path != lacking:
            want = want + 0.25 * b2.modules[path].delta()
        assert torch.allclose(new_delta(mod), want, atol=1e-5), path  # total rank 4 <= r: exact
        assert mod.lora_B["default"].weight.abs().sum() > 0  # no longer PEFT's B = 0

    small = peft_model(tiny_base, rank=1)
    assert init_from_blocks(small, [(b1, 3.0), (b2, 1.0)]) == 4
    for path, mod in lora_layers(small).items():
        target = 0.75 * b1.modules[path].delta() + (0.25 * b2.modules[path].delta() if path != lacking else 0)
        U, S, Vh = torch.linalg.svd(target, full_matrices=False)
        best = S[0] * U[:, :1] @ Vh[:1]
        assert torch.allclose(new_delta(mod), best, atol=1e-5), path
        assert not torch.allclose(new_delta(mod), target, atol=1e-3)  # a real truncation


def test_init_from_blocks_keeps_unused_rank_trainable_and_missing_modules_untouched(tiny_base) -> None:  # type: ignore[no-untyped-def]
    model = peft_model(tiny_base, rank=6)
    paths = sorted(lora_layers(model))
    before = {p: lora_layers(model)[p].lora_A["default"].weight.detach().clone() for p in paths}
    only_q = random_adapter(model, rank=2, scaling=1.0, seed=3, skip=tuple(p for p in paths if p.endswith("v_proj")))

    assert init_from_blocks(model, [(only_q, 1.0)]) == 2
    for path, mod in lora_layers(model).items():
        A, B = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        if path.endswith("v_proj"):  # no block has it: PEFT's init (B = 0, A random) stays
            assert torch.equal(A, before[path]) and B.abs().sum() == 0
            continue
        assert torch.allclose(new_delta(mod), only_q.modules[path].delta(), atol=1e-5)
        # rank 2 of 6 used: the other 4 components are B = 0 with nonzero A rows, so gradients can grow them
        assert (B[:, :2].norm(dim=0) > 0).all() and B[:, 2:].abs().sum() == 0
        assert (A[2:].norm(dim=1) > 0).all()


def test_empty_memory_is_plain_fit(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    data = encode(tok, TASK_A + TASK_B)
    args = {"epochs": 2.0, "batch_size": 3, "learning_rate": 1e-2, "seed": 7, "warmup_ratio": 0.2}
    plain = fit(peft_model(tiny_base, rank=2), data, pad_id(tok), **args)  # type: ignore[arg-type]
    kif = peft_model(tiny_base, rank=2)
    train_kif(kif, data, [], pad_id(tok), Schedule(**args))  # type: ignore[arg-type]
    a, b = trainable(plain), trainable(kif)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not kif.training


def test_one_cycle_changes_only_the_masked_coordinates(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    model = peft_model(tiny_base, rank=4)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = trainable(model)
    # every backward's raw gradient and the θ it was taken at, and θ after every step
    grads: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in params}
    for n, p in params.items():
        p.register_hook(lambda g, n=n, p=p: grads[n].append((g.detach().clone(), p.detach().clone())))  # type: ignore[misc]
    seen: list[Progress] = []
    after: list[dict[str, torch.Tensor]] = []

    def on_progress(progress: Progress) -> None:
        seen.append(progress)
        after.append(trainable(model))

    # 4 examples at batch size 2 = 2 inner steps = exactly one cycle, then one outer step
    settings = KIFSettings(inner_steps=2, top_q=0.2)
    one_cycle(model, tok, settings, on_progress)
    assert [p.step for p in seen] == [1, 2, 3] and {p.total for p in seen} == {3}
    assert all(p.tokens > 0 for p in seen) and seen[-1].tokens > seen[0].tokens
    for name, value in trainable(model).items():
        changed = (value != start[name]).float().mean().item()
        assert 0 < changed <= 0.4, (name, changed)  # the union of two 20% masks, the rest back at the start

        # the exact rule, recomputed: θ = start + m_in ⊙ τ_in + m_out ⊙ τ_out with masks from |g ⊙ θ| EMAs
        assert len(grads[name]) == 3
        i_in = torch.zeros_like(value)
        for g, theta in grads[name][:2]:
            i_in.mul_(settings.ema_in).add_((g * theta).abs(), alpha=1 - settings.ema_in)
        g, theta = grads[name][2]
        i_hist = (1 - settings.ema_hist) * (g * theta).abs()
        k = int(0.2 * value.numel())

        def top(i: torch.Tensor, k: int = k) -> torch.Tensor:
            return torch.zeros(i.numel()).index_fill_(0, i.flatten().topk(k).indices, 1.0).view_as(i)

        mid, end = after[1][name], after[2][name]
        want = start[name] + top(i_in) * (mid - start[name]) + top(i_hist) * (end - mid)
        assert torch.allclose(value, want, atol=1e-7), name
        assert not torch.allclose(value, start[name] + top(i_in) * (mid - start[name]), atol=1e-7)  # τ_out counts


def test_default_fusion_keeps_the_whole_cycle(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    """By default (top_q 1.0) the fusion keeps every coordinate of both updates: θ ends where the cycle's task
    steps and memory step left it, so the new task's learning is not cut (SuperNI relation extraction scored
    50.4 under top_q 0.2 against 88.0 trained alone)."""
    assert KIFSettings().top_q == 1.0 and TrainConfig().kif_top_q == 1.0
    model = peft_model(tiny_base, rank=4)
    start = trainable(model)
    after: list[dict[str, torch.Tensor]] = []
    # one cycle of 2 task steps, then the outer step on the memory batch
    one_cycle(model, tok, KIFSettings(inner_steps=2), lambda _: after.append(trainable(model)))
    assert len(after) == 3
    for name, value in trainable(model).items():
        assert torch.equal(value, after[2][name]), name  # nothing fell back to the cycle start
        assert not torch.equal(value, start[name])
        assert not torch.equal(after[2][name], after[1][name])  # and the memory step moved it


def test_at_the_default_share_skipping_the_fusion_leaves_the_same_parameters(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    """At top_q 1.0 the masks keep every coordinate, so start + τ_in + τ_out is where the cycle ended: the loop
    skips the importance EMAs, snapshots and masks, and ends where doing them all would have left it."""

    def run(fuse: bool) -> dict[str, torch.Tensor]:
        model = peft_model(tiny_base, rank=4)
        if not fuse:
            method = KIF(model, encode(tok, TASK_A), KIFSettings(inner_steps=2), seed=0)
            assert method.fuse is False and method.imp_in == []  # nothing tracked at the default share
        else:  # the full masked fusion, as the loop did before it skipped it
            method = KIF(model, encode(tok, TASK_A), KIFSettings(inner_steps=2), seed=0, fuse=True)
            assert len(method.imp_in) == len(method.params)
        # 5 examples at batch size 2: a full cycle of 2 task steps and a partial one of 1, each with an outer step
        TrainLoop(method, encode(tok, TASK_B + TASK_C[:1]), pad_id(tok), Schedule(1.0, 2, 1e-2, 0)).run()
        return trainable(model)

    skipped, fused = run(False), run(True)
    assert skipped.keys() == fused.keys()
    for name in skipped:
        assert torch.allclose(skipped[name], fused[name], atol=1e-6, rtol=0), name


def test_progress_counts_outer_steps_and_stop_cancels(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    model = peft_model(tiny_base, rank=2)
    seen: list[Progress] = []
    calls = 0

    def stop() -> bool:
        nonlocal calls
        calls += 1
        return calls > 4

    # 5 examples at batch size 2: 3 inner steps = one cycle of 2 + a partial cycle of 1, so 2 outer steps
    with pytest.raises(Cancelled):
        train_kif(
            model,
            encode(tok, TASK_B + TASK_C[:1]),
            encode(tok, TASK_A),
            pad_id(tok),
            Schedule(epochs=1.0, batch_size=2, learning_rate=1e-2, seed=0),
            KIFSettings(inner_steps=2),
            on_progress=seen.append,
            should_stop=stop,
        )
    assert [p.step for p in seen] == [1, 2, 3, 4] and {p.total for p in seen} == {5}
    assert all(p.loss is not None for p in seen)


def test_memory_replay_protects_the_earlier_task(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    a, b, c = encode(tok, TASK_A), encode(tok, TASK_B), encode(tok, TASK_C)

    def loss_on(model: nn.Module, data: list[Encoded]) -> float:
        with torch.no_grad():
            return float(answer_loss(model, collate(data, pad_id(tok))))

    first = peft_model(tiny_base, rank=4)
    untrained = loss_on(first, a)
    fit(first, a, pad_id(tok), epochs=20.0, batch_size=4, learning_rate=5e-2, seed=0)
    assert loss_on(first, a) < untrained - 0.1  # task A was learned
    block_a = block_of(first)

    def learn_b(memory: list[Encoded] | None) -> nn.Module:
        model = peft_model(tiny_base, rank=4, seed=10)
        init_from_blocks(model, [(block_a, 1.0)])  # the new block starts from A's, as in skillpool
        args = {"epochs": 12.0, "batch_size": 4, "learning_rate": 5e-2, "seed": 0}  # 12 inner + 3 outer steps
        if memory is None:
            return fit(model, b, pad_id(tok), **args)  # type: ignore[arg-type]
        train_kif(model, b, memory, pad_id(tok), Schedule(**args), KIFSettings(inner_steps=4))  # type: ignore[arg-type]
        return model

    plain, kif, kif_other = learn_b(None), learn_b(a), learn_b(c)
    assert loss_on(kif, a) < loss_on(plain, a)  # KIF forgets less of A than plain training
    # and because of what it replays, not because it moves less: a memory of an unrelated task protects A less
    assert loss_on(kif, a) < loss_on(kif_other, a)
    assert loss_on(kif, b) < loss_on(first, b)  # while B is still learned


def test_choose_start_takes_a_block_that_fits_and_refuses_one_that_hurts(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    a = encode(tok, TASK_A)
    first = peft_model(tiny_base, rank=4)
    fit(first, a, pad_id(tok), epochs=20.0, batch_size=4, learning_rate=5e-2, seed=0)
    block_a = block_of(first)
    noise = random_adapter(first, rank=4, scaling=8.0, seed=5)  # large random deltas: confidently wrong

    model = peft_model(tiny_base, rank=4, seed=1)
    choice = choose_start(model, {"a": (block_a, 0.6), "noise": (noise, 0.4)}, a, pad_id(tok), margin=0.02)
    assert [c["blocks"] for c in choice.candidates] == [{}, {"a": 1.0}, {"noise": 1.0}, {"a": 0.6, "noise": 0.4}]
    losses = [float(c["loss"]) for c in choice.candidates]  # type: ignore[arg-type]
    assert losses[1] < losses[0] < losses[2]  # the learned block helps task A, the noise hurts it
    assert choice.blocks == {"a": 1.0}
    assert probe_loss(model, a, pad_id(tok)) == pytest.approx(losses[1], rel=1e-5)  # the model is at that start
    for path, mod in lora_layers(model).items():
        assert torch.allclose(new_delta(mod), block_a.modules[path].delta(), atol=1e-5)

    other = peft_model(tiny_base, rank=4, seed=2)
    init = trainable(other)
    refused = choose_start(other, {"noise": (noise, 1.0)}, a, pad_id(tok), margin=0.02)
    assert refused.blocks == {} and [c["blocks"] for c in refused.candidates] == [{}, {"noise": 1.0}]
    after = trainable(other)
    assert all(torch.equal(init[k], after[k]) for k in init)  # PEFT's init back, bit for bit
    assert probe_loss(other, a, pad_id(tok)) == pytest.approx(float(refused.candidates[0]["loss"]), rel=1e-6)  # type: ignore[arg-type]

    # the margin: a block must beat fresh by that share, not by any amount
    strict = choose_start(peft_model(tiny_base, rank=4, seed=1), {"a": (block_a, 1.0)}, a, pad_id(tok), margin=0.99)
    assert strict.blocks == {}


def test_start_trial_keeps_the_start_that_trains_better_and_resumes_it(tiny_base, tok) -> None:  # type: ignore[no-untyped-def]
    a, memory = encode(tok, TASK_A), encode(tok, TASK_C)
    first = peft_model(tiny_base, rank=4)
    fit(first, a, pad_id(tok), epochs=20.0, batch_size=4, learning_rate=5e-2, seed=0)
    blocks = {"a": block_of(first), "noise": random_adapter(first, rank=4, scaling=8.0, seed=5)}
    # 4 task steps at batch size 2 in cycles of 2: 2 outer steps; the trial is the first cycle (2 + 1 steps)
    schedule, settings = Schedule(epochs=2.0, batch_size=2, learning_rate=1e-2, seed=0), KIFSettings(inner_steps=2)

    def alone(seed: int, start: dict[str, float]) -> dict[str, torch.Tensor]:
        model = peft_model(tiny_base, rank=4, seed=seed)
        init_from_blocks(model, [(blocks[n], w) for n, w in start.items()])
        train_kif(model, a, memory, pad_id(tok), schedule, settings)
        return trainable(model)

    model, seen = peft_model(tiny_base, rank=4, seed=1), []
    trial = StartTrial(blocks, [{}, {"a": 1.0}], a, margin=0.02)
    finalists = train_kif(model, a, memory, pad_id(tok), schedule, settings, trial, on_progress=seen.append)
    assert [f["blocks"] for f in finalists] == [{}, {"a": 1.0}]
    fresh_loss, a_loss = (float(f["held_out_loss"]) for f in finalists)  # type: ignore[arg-type]
    assert a_loss < fresh_loss * 0.98 and finalists[1]["kept"] is True and "kept" not in finalists[0]
    kept = trainable(model)
    for name, value in alone(1, {"a": 1.0}).items():  # resumed after its trial: the same as training from it alone
        assert torch.allclose(kept[name], value, atol=1e-6), name
    assert [p.step for p in seen] == list(range(1, 10)) and {p.total for p in seen} == {9}  # 6 kept + 3 tried

    model = peft_model(tiny_base, rank=4, seed=2)
    trial = StartTrial(blocks, [{}, {"noise": 1.0}], a, margin=0.02)
    refused = train_kif(model, a, memory, pad_id(tok), schedule, settings, trial)
    assert refused[0]["kept"] is True and "kept" not in refused[1]
    # the noise start is not 2% better than fresh after its cycle, so fresh trains on
    assert float(refused[1]["held_out_loss"]) >= 0.98 * float(refused[0]["held_out_loss"])  # type: ignore[arg-type]
    kept = trainable(model)
    for name, value in alone(2, {}).items():  # fresh again, from PEFT's init restored bit for bit
        assert torch.allclose(kept[name], value, atol=1e-6), name

    with pytest.raises(ValueError, match="held-out rows"):
        StartTrial(blocks, [{}], [], margin=0.02)


@pytest.mark.parametrize(
    ("field", "value"),
    [("inner_steps", 0), ("ema_in", 1.0), ("ema_hist", -0.1), ("top_q", 0.0), ("top_q", 1.5), ("init_blocks", -1)],
)
def test_settings_are_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        KIFSettings(**{field: value})  # type: ignore[arg-type]
    KIFSettings(top_q=1.0, ema_in=0.0, init_blocks=0)  # the bounds that are allowed


@pytest.mark.parametrize("top_q", [1.0, 0.5])
def test_checkpointing_gives_the_same_kif_block(tiny_base, tok, top_q: float) -> None:  # type: ignore[no-untyped-def]
    """Task steps, memory steps and (below share 1.0) the importance EMAs and the masked fusion, all of which read
    the gradients, end at the same parameters with the decoder layers recomputed in backward."""
    new, memory = encode(tok, TASK_B), encode(tok, TASK_C)
    settings = KIFSettings(inner_steps=2, top_q=top_q)
    runs = {}
    for on in (False, True):
        model = peft_model(tiny_base, rank=4)
        train_kif(model, new, memory, pad_id(tok), Schedule(3.0, 2, 1e-2, 0, checkpointing=on), settings)
        runs[on] = trainable(model)
    assert any(not torch.equal(v, trainable(peft_model(tiny_base, rank=4))[n]) for n, v in runs[False].items())
    for name, value in runs[False].items():
        assert torch.allclose(runs[True][name], value, rtol=0, atol=1e-6), name
