"""The offline host's side of device_carry.py (standard library only; it runs where skillpool is not installed).

    python3 .devcarry/sp-N/device_unpack.py [--parts /tmp/spc] [--root /tmp]

joins the parts, checks their checksum, unpacks vLLM into ROOT/vsite (when the pack holds it), installs the wheels
into ROOT/site with pip (no index, no dependency resolution: the pack holds exactly what the host lacks), copies the
model packages there and SmolLM2's config and tokenizer into ROOT/base-config, and prints the one line to `eval`: the PYTHONPATH export (ROOT/site first) and vLLM's settings.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def joined(parts_dir: Path, want: str) -> bytes:
    parts = sorted(parts_dir.glob("part.*"))
    data = b"".join(p.read_bytes() for p in parts)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(
            f"device_unpack: checksum mismatch over {len(parts)} parts in {parts_dir} ({got[:12]} != {want[:12]}): "
            "a chunk is missing or from another pack; start again from the first call"
        )
    return data


def install(data: bytes, root: Path) -> list[str]:
    """Unpack into root; returns the PYTHONPATH entries, the first one first."""
    site, vsite = root / "site", root / "vsite"
    with tempfile.TemporaryDirectory(prefix="spc-", dir=root) as tmp:
        work = Path(tmp)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as t:
            t.extractall(work, filter="data")
        paths = [str(site)]
        if (work / "vsite.tar.xz").is_file():
            with tarfile.open(work / "vsite.tar.xz", mode="r:xz") as t:
                t.extractall(vsite, filter="fully_trusted")  # vLLM's own files, as device-vllm's unpack.py does
            paths.append(str(vsite))
        wheels = sorted(str(w) for w in (work / "wheels").glob("*.whl"))
        if wheels:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            subprocess.run([*pip, "--upgrade", "--target", str(site), *wheels], check=True)
        site.mkdir(parents=True, exist_ok=True)
        for pkg in sorted((work / "models").glob("*")):
            shutil.rmtree(site / pkg.name, ignore_errors=True)
            shutil.copytree(pkg, site / pkg.name)
        if (work / "base-config").is_dir():
            shutil.rmtree(root / "base-config", ignore_errors=True)
            shutil.copytree(work / "base-config", root / "base-config")
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=Path, default=Path("/tmp/spc"), help="where the calls copied every part.*")
    ap.add_argument("--root", type=Path, default=Path("/tmp"), help="site/ and vsite/ go here")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    data = joined(args.parts, (here / "sha256").read_text().strip())
    args.root.mkdir(parents=True, exist_ok=True)
    paths = install(data, args.root)
    print(f"device_unpack: {len(data) / 2**20:.0f} MiB unpacked into {', '.join(paths)}", file=sys.stderr)
    print(f"export PYTHONPATH={':'.join(paths)}${{PYTHONPATH:+:$PYTHONPATH}} VLLM_USE_FLASHINFER_SAMPLER=0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
