"""`skillpool import DIR --name NAME --examples FILE`: bring a PEFT LoRA folder to a running server as a skill, then
follow the import job until it ends (as `skillpool upload` follows a training job).

Only the folder's two PEFT files are sent (adapter_config.json and adapter_model.safetensors, in a tar.gz), so the
model card PEFT writes beside them stays home; the server checks them against its base model."""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

from .upload import submit_and_follow

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a PEFT LoRA folder holds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--name", required=True, help="skill name")
    p.add_argument(
        "--examples", type=Path, required=True, help="JSONL of requests it answers (upload formats, answers optional)"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--force", action="store_true", help="register even if the quality gate fails (admin)")
    p.add_argument("--new-version", action="store_true", help="import as a new version of a skill that exists")
    p.add_argument("--api-key", default=None, help="a key with role train or admin, when the server has keys")
    p.add_argument("--no-wait", action="store_true", help="print the job and return at once")


def pack(folder: Path) -> bytes:
    """The folder's PEFT files as a tar.gz (a missing one is left for the server to name)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name in ADAPTER_FILES:
            if (folder / name).is_file():
                archive.add(folder / name, arcname=f"{folder.name or 'adapter'}/{name}")
    return out.getvalue()


def run(args: argparse.Namespace) -> int:
    """Import, then follow; exit 0 only if the job succeeded. Errors print the server's message."""
    if not args.folder.is_dir():
        print(
            f"{args.folder} is not a folder (a PEFT LoRA folder holds {' and '.join(ADAPTER_FILES)})", file=sys.stderr
        )
        return 1
    adapter, examples = pack(args.folder), args.examples.read_bytes()
    return submit_and_follow(
        args,
        lambda client: client.import_adapter(
            args.name, adapter, examples, force=args.force, new_version=args.new_version
        ),
    )
