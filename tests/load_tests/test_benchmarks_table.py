"""docs/benchmarks.md's table of scripts and load_tests/ agree: every runnable benchmark (a module run with
`python -m`, or the Locust file) has a row naming it and the command that runs it, and every row names a script
that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "benchmarks.md"


def runnable() -> set[str]:
    """KIND/NAME of each script under load_tests/KIND/ that runs on its own."""
    found = set()
    for f in (ROOT / "load_tests").glob("*/*.py"):
        text = f.read_text(encoding="utf-8")
        if 'if __name__ == "__main__"' in text or f.name == "locustfile.py":
            found.add(f"{f.parent.name}/{f.stem}")
    return found


def rows() -> dict[str, str]:
    """The table's rows: script cell -> the whole row."""
    section = TABLE.read_text(encoding="utf-8").split("## The scripts", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `([a-z_]+/[a-z_]+)` \|", line))}


def test_every_runnable_benchmark_has_a_row_and_every_row_a_script() -> None:
    scripts, table = runnable(), rows()
    assert len(scripts) >= 20  # the glob found the benchmarks where they live
    assert not scripts - set(table), f"benchmarks without a row in docs/benchmarks.md: {sorted(scripts - set(table))}"
    assert not set(table) - scripts, f"rows naming no runnable script: {sorted(set(table) - scripts)}"


def test_each_row_gives_the_command_that_runs_its_script() -> None:
    for script, line in rows().items():
        kind, name = script.split("/")
        command = f"load_tests/{kind}/{name}.py" if name == "locustfile" else f"-m load_tests.{kind}.{name}"
        assert command in line, f"the row of {script} does not run it with {command}"
