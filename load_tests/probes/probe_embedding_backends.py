"""Probe cheaper CPU embeddings for the router: the same MiniLM weights through torch (what the router runs),
onnxruntime fp32 and onnxruntime dynamic int8, on the same routed texts in one run (evidence for the `auto`
routing-speed work; the results go to docs, not to defaults).

sentence-transformers' own ONNX/OpenVINO backends need `optimum-onnx`, which pins transformers < 4.58 while
sentence-transformers 6 needs transformers 5, so the fp32 graph is the router's own `torch.onnx.export`
(router/embedder_onnx.py). Run from the repository root:
`.venv/bin/python -m load_tests.probes.probe_embedding_backends --out /tmp/probe`.

It prints per-request milliseconds at batch 1 and 16 with 1 and 2 threads, each backend's ratio to torch, and
the lowest cosine similarity of each backend's embeddings to torch's (1.0: the same routes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from load_tests.common.datasets import datasets

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def routed_texts(per_task: int) -> list[str]:
    """The first test rows of every Long Sequence task under SKILLPOOL_DATASETS, as the router sees them."""
    folder = datasets() / "long_sequence"
    texts = []
    for f in sorted(folder.glob("*/test.jsonl")):
        with f.open() as fh:
            for i, line in enumerate(fh):
                if i >= per_task:
                    break
                r = json.loads(line)
                texts.append(r["instruction"] + "\n" + r["input"])
    if not texts:
        raise SystemExit(f"no Long Sequence tasks under {folder}")
    return texts


def export(out: Path) -> tuple[Path, Path]:
    """The router's own fp32 graph (router/embedder_onnx.py, cached), and its dynamic int8 quantization."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from skillpool.router.embedder import packaged_minilm_path
    from skillpool.router.embedder_onnx import export_onnx

    path = Path(packaged_minilm_path())
    max_len = int(json.loads((path / "sentence_bert_config.json").read_text()).get("max_seq_length", 256))
    fp32, int8 = export_onnx(path, max_len), out / "minilm.int8.onnx"
    if not int8.exists():
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return fp32, int8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the int8 model")
    ap.add_argument("--per-task", type=int, default=20, help="test rows per Long Sequence task")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import onnxruntime as ort

    from skillpool.router.embedder import SentenceEmbedder

    texts = routed_texts(a.per_task)
    emb = SentenceEmbedder(device="cpu")
    st = emb.model
    fp32, int8 = export(a.out)
    ref = emb.embed(texts)

    def ort_runner(path: Path, threads: int) -> Any:
        o = ort.SessionOptions()
        o.intra_op_num_threads, o.inter_op_num_threads = threads, 1
        return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])

    def ort_embed(s: Any, batch: list[str]) -> np.ndarray:
        enc = st.tokenizer(batch, padding=True, truncation=True, max_length=st.max_seq_length, return_tensors="np")
        feed = {k: enc[n].astype(np.int64) for k, n in (("ids", "input_ids"), ("mask", "attention_mask"))}
        feed["tt"] = enc["token_type_ids"].astype(np.int64)
        h = s.run(None, feed)[0]
        m = enc["attention_mask"][..., None].astype(np.float32)
        v = (h * m).sum(1) / m.sum(1)
        return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True))

    def per_request_ms(fn: Callable[[list[str]], object], bs: int) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for i in range(0, len(texts), bs):
                fn(texts[i : i + bs])
            best = min(best, (time.perf_counter() - t) / len(texts))
        return best * 1e3

    print(f"{len(texts)} routed texts, max_seq_length {st.max_seq_length}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        s32, s8 = ort_runner(fp32, threads), ort_runner(int8, threads)
        cos = {}
        for name, s in (("fp32", s32), ("int8", s8)):
            e = np.concatenate([ort_embed(s, texts[i : i + 16]) for i in range(0, len(texts), 16)])
            cos[name] = float((e * ref).sum(1).min())
        for bs in (1, 16):
            tt = per_request_ms(emb.embed, bs)
            t32 = per_request_ms(functools.partial(ort_embed, s32), bs)
            t8 = per_request_ms(functools.partial(ort_embed, s8), bs)
            print(
                f"threads={threads} batch={bs}: torch {tt:.1f} ms/request, onnxruntime fp32 {t32:.1f} "
                f"({tt / t32:.2f}x faster), int8 {t8:.1f} ({tt / t8:.2f}x); lowest cosine to torch: "
                f"fp32 {cos['fp32']:.6f}, int8 {cos['int8']:.4f}"
            )


if __name__ == "__main__":
    main()
