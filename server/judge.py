"""The quality gate's answers from the serving engine: a skill is judged by the engine that will serve it.

The candidate block is added to the engine under a key no request can name; earlier skills are the
ones the engine already serves. Probe requests join the running batch like any other request.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from skillpool.lora.adapter import LoRAAdapter
from skillpool.lora.mix import Mix
from skillpool.trainer.service import Prompt

from .engines import Engine, EngineEvent, EngineRequest, SamplingParams

_ids = itertools.count()


class EngineJudge:
    def __init__(self, engine: Engine, timeout_s: float = 3600) -> None:
        self.engine, self.timeout_s = engine, timeout_s

    def candidate(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        key = f"{name}@candidate-{next(_ids)}"  # '@' is not allowed in skill names: no request can route here
        self.engine.add_skill(key, load)
        return key

    def registered(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        return name  # the server's pool registered it in this engine

    def remove(self, key: str) -> None:
        self.engine.remove_skill(key)

    def generate(self, prompts: Sequence[Prompt], mixes: Sequence[Mix], max_tokens: int) -> list[str]:
        texts: list[list[str]] = [[] for _ in prompts]
        errors: list[str] = []
        left = threading.Semaphore(0)
        for i, (messages, mix) in enumerate(zip(prompts, mixes)):

            def sink(ev: EngineEvent, i: int = i) -> None:
                texts[i].append(ev.text)
                if ev.finish_reason is not None:
                    if ev.finish_reason == "error":
                        errors.append(ev.error or "generation failed")
                    left.release()

            ids = self.engine.encode_chat(messages)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            self.engine.submit(EngineRequest(f"gate-{next(_ids)}", ids, params, mix), sink)
        for _ in prompts:
            if not left.acquire(timeout=self.timeout_s):
                raise TimeoutError("the quality gate's probe requests did not finish")
        if errors:
            raise RuntimeError(f"quality gate generation failed: {errors[0]}")
        return ["".join(t) for t in texts]
