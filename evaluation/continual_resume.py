"""`eval continual --resume`: what a cut-short run measured and the setup a resumed run must share with it.

The progress log's first line holds the run's setup (run_setup); earlier_steps reads the rest of the log back
into the steps a resumed run keeps, so that only what the cut run did not measure is measured again.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from skillpool.trainer.config import as_recorded_now

from .continual_task import Task
from .progress_log import RUN
from .run_options import training_setup


@dataclass
class Earlier:
    """What a cut-short run with the same setup measured, kept by --resume: the server side's steps (the method's
    line and the forced line) for its first tasks, and the baseline sides that finished, by their lines."""

    server: list[tuple[dict[str, Any], dict[str, Any]]]
    sides: dict[str, list[dict[str, Any]]]

    def lines(self) -> list[dict[str, Any]]:
        return [line for step in self.server for line in step] + [line for s in self.sides.values() for line in s]


def earlier_steps(
    lines: list[dict[str, Any]], setup: dict[str, Any], method: str, names: list[str], kinds: list[str]
) -> Earlier:
    """The steps of a progress log that a resumed run keeps. The server side goes on after the longest prefix
    of tasks it scored whole; a baseline side is kept only when it finished (a side restarts from its start, as
    seq's one LoRA is not stored)."""
    if not lines or lines[0].get("side") != RUN:
        raise SystemExit("--resume: the progress log does not start with its run's setup (written before --resume?)")
    before = {**lines[0]["setup"]}
    before["train_config"] = as_recorded_now(before.get("train_config"))
    for key, value in setup.items():
        if before.get(key) != value:
            raise SystemExit(f"--resume: the cut run had {key} {before.get(key)!r}, this one {value!r}")
    last = {(x["side"], x["after"]): x for x in lines[1:]}  # a step measured twice: the later line
    server = []
    for name in names:
        if (method, name) not in last or ("forced", name) not in last:
            break
        server.append((last[method, name], last["forced", name]))
    sides = {}
    for kind in kinds:
        mine = [x for x in lines[1:] if x["side"] == kind]
        if [x["after"] for x in mine] == (names[-1:] if kind == "mtl" else names):
            sides[kind] = mine
    return Earlier(server, sides)


def run_setup(args: argparse.Namespace, tasks: list[Task], model_id: str) -> dict[str, Any]:
    """What a resumed run must share with the run it goes on with (the progress log's first line)."""
    return {
        "tasks": [t.name for t in tasks],
        **training_setup(args),
        "router_mode": args.router_mode,
        "model": model_id,
        "force": args.force,
    }
