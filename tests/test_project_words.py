"""The project speaks of itself: no tracked file names a work item, the machine it was built on, or the
environment it was built in. Each hit is reported with its file and line, so the fix is a rewording there.

The patterns are spelled in pieces so that this file does not match them itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "a work-item number": re.compile(r"\b(issue|stop)s?\s+#?\d", re.I),
    "a word for a borrowed machine": re.compile(r"\b" + "le" + r"nt\b", re.I),
    "the build environment's time budget": re.compile("device" + r"\s+time", re.I),
    "the build environment's session": re.compile(r"\bthis\s+" + "sess" + "ion", re.I),
    "the build environment's transfer harness": re.compile("device" + "_carry", re.I),
    "an absolute path of a build machine": re.compile(r"(?<![\w.])/(wo" + "rk|ro" + r"ot)/"),
    "a path outside the repository": re.compile(r"\.\./sha" + "red"),
}
# CI's script is where the datasets beside the checkout are named, once, as SKILLPOOL_DATASETS
ALLOWED = {(".ci/run", "a path outside the repository")}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / name for name in out.decode().split("\0") if name]


def hits(path: Path, root: Path = ROOT) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return []  # binary, or deleted in the working tree
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line) and (str(path.relative_to(root)), what) not in ALLOWED:
                found.append(f"{path.relative_to(root)}:{n}: {what}: {line.strip()[:120]}")
    return found


def test_no_tracked_file_speaks_of_how_it_was_built() -> None:
    found = [h for path in tracked_files() for h in hits(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_word(tmp_path: Path) -> None:
    samples = [
        "see " + "issue" + " 46",
        "as in " + "stop" + " 51",
        "the " + "le" + "nt GPU",
        "device" + " time left",
        "in this " + "sess" + "ion",
        "device" + "_carry.py",
        "cd " + "/wo" + "rk/main",
        "../sha" + "red/datasets",
    ]
    for i, sample in enumerate(samples):
        page = tmp_path / f"sample{i}.md"
        page.write_text(f"fine line\n{sample}\n", encoding="utf-8")
        assert hits(page, tmp_path), sample
    clean = tmp_path / "clean.md"
    clean.write_text('scope="session"; an InferenceSession; silent; /tmp/x; issues of the pool\n', encoding="utf-8")
    assert not hits(clean, tmp_path)
