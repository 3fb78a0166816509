"""The hooks' way into vLLM's spawned worker process without an installed entry point: the engine names
`MixWorkerExtension` as `worker_extension_cls`, vLLM imports this module in the worker before it builds the
worker and its model, and the import runs `register()` (which honours SKILLPOOL_VLLM_MIX and the version check).
"""

from __future__ import annotations

from . import plugin

plugin.register()


class MixWorkerExtension:
    """Adds nothing to the worker: naming it is what loads the hooks."""
