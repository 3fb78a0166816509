"""`eval continual`'s progress log: one JSON line per measured step, appended the moment a side measures it.

A run can be cut short (a GPU lease ends, the machine reboots) long after most of it was measured; its
--json file is written only at the end, so the log is what such a run keeps. It lies beside the --json file as
`<stem>.progress.jsonl`, and every line is complete on its own: the side (the method, "forced", "seq", "mtl"
or "single"), the task just learned, each scored task's mean and its per-row scores, and the seconds the step's
training (a baseline) or scoring (the method) took, so a resumed run's times stay whole. With --parallel the sides
are separate processes, so each line goes out as one O_APPEND write and lines never interleave.

The first line (side "run") records the run's setup, so that `eval continual --resume` can check that it goes
on with the same tasks, limits and hyperparameters, and keep the steps measured before the cut.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .continual_metrics import row_mean

RUN = "run"  # the first line's side: the run's setup


def log_path(json_path: Path) -> Path:
    return json_path.with_name(json_path.stem + ".progress.jsonl")


@dataclass(frozen=True)
class ProgressLog:
    """Appends a run's measured steps to `path` (None: a run that keeps no log). Picklable, so a baseline in
    its own process writes to the same file."""

    path: Path | None = None

    @classmethod
    def fresh(
        cls, path: Path, setup: dict[str, Any] | None = None, kept: list[dict[str, Any]] | None = None
    ) -> ProgressLog:
        """A log that starts anew: the run's setup as its first line, then the steps a resumed run keeps (`kept`),
        so a rerun with the same --json does not mix its lines with the last run's. Swapped in whole: a crash
        leaves the old log or the new one, never a mix."""
        lines = ([] if setup is None else [{"side": RUN, "setup": setup}]) + (kept or [])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        os.replace(tmp, path)
        return cls(path)

    def scored(self, side: str, after: str, rows: dict[str, list[float]], **extra: Any) -> None:
        """One step: after learning `after`, `side` scored these tasks' test rows (points, 0-100)."""
        if self.path is None:
            return
        record = {
            "side": side,
            "after": after,
            "scores": {name: round(row_mean(r), 2) for name, r in rows.items()},
            **extra,
            "rows": rows,
            "time": round(time.time(), 1),
            "pid": os.getpid(),  # which process measured it (--parallel: one per side)
        }
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while line:  # a regular file takes it in one write; the loop only guards a short one
                line = line[os.write(fd, line) :]
        finally:
            os.close(fd)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The steps a run logged, in the order they were measured."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
