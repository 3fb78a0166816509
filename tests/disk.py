"""A small real filesystem to fill: a tmpfs mounted for one test (root only, as CI runs), filled and freed."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(folder: Path, size: str = "8m") -> Iterator[Path]:
    """`folder` as a fresh tmpfs of `size` for the block; skips the test where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("the disk-full tests mount a tmpfs, which needs root (CI runs as root)")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {folder}: {done.stderr.strip() or done.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Write a ballast file in `folder` until its filesystem has no byte left; returns the ballast."""
    ballast = folder / f".ballast-{len(list(folder.glob('.ballast-*')))}"
    chunk = b"\0" * 65536
    with ballast.open("ab", buffering=0) as fh:  # unbuffered: nothing left to flush on close
        try:
            while True:
                fh.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    probe = folder / ".probe"
    with pytest.raises(OSError):  # the disk is really full: no new page for anyone
        with probe.open("wb", buffering=0) as fh:
            fh.write(b"x")
    probe.unlink(missing_ok=True)
    return ballast


def temp_leftovers(root: Path) -> list[Path]:
    """Every temp file or folder under `root` (a '.tmp' name, an owner tag, or anything in the store's tmp/)."""
    found = [p for p in root.rglob("*") if p.name.endswith(".tmp") or "~" in p.name]
    return found + (list((root / "tmp").iterdir()) if (root / "tmp").is_dir() else [])
