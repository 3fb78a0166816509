"""`skillpool` console script: the argparse tree, each command's module imported only when that command runs.

serve -> skillpool.server.cli, worker -> skillpool.trainer.jobs.worker, upload -> skillpool.evaluation.upload,
import -> skillpool.evaluation.import_adapter, eval routing|continual|answers|answers-compare -> skillpool.evaluation.routing|continual|answers|answers_compare.
So `skillpool worker` never loads the server.
Each module defines `add_arguments(parser)` and `run(args)`.
"""

from __future__ import annotations

from skillpool.runtime.process import set_process_env

set_process_env()  # before any command loads torch: OpenMP reads its variables once

import argparse  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class Command:
    module: str  # defines add_arguments(parser) and run(args)
    help: str


COMMANDS = {
    "serve": Command("skillpool.server.cli", "run the OpenAI-compatible server with an in-process trainer"),
    "worker": Command(
        "skillpool.trainer.jobs.worker", "run a trainer worker that pulls jobs from Redis and writes to a shared store"
    ),
    "upload": Command(
        "skillpool.evaluation.upload", "upload a task file to a running server and follow the training job"
    ),
    "import": Command(
        "skillpool.evaluation.import_adapter",
        "import a PEFT LoRA folder and its example requests into a running server as a skill",
    ),
}
EVAL = {
    "routing": Command(
        "skillpool.evaluation.routing",
        "learn tasks one by one into a fresh router and measure routing after each",
    ),
    "continual": Command(
        "skillpool.evaluation.continual",
        "learn a task sequence through the server; score matrix, AP, F.Ra, FWT, BWT, baselines",
    ),
    "answers": Command(
        "skillpool.evaluation.answers",
        "answer quality under paraphrased instructions: forced and routed, four wordings, paired gaps",
    ),
    "answers-compare": Command(
        "skillpool.evaluation.answers_compare",
        "two eval answers runs (before and after a change) cell by cell, with paired intervals",
    ),
}


def _add(sub: argparse._SubParsersAction, name: str, cmd: Command, chosen: bool) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(name, help=cmd.help)
    if chosen:  # only the command that runs is imported: its flags are defined in its own module
        importlib.import_module(cmd.module).add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    word = lambda i: argv[i] if len(argv) > i else None  # noqa: E731  # the command words, before any flag
    parser = argparse.ArgumentParser(
        prog="skillpool", description="An OpenAI-compatible server over a growing pool of LoRA skills"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        _add(sub, name, cmd, word(0) == name)
    ev = sub.add_parser("eval", help="benchmarks that are part of the product").add_subparsers(
        dest="what", required=True
    )
    for name, cmd in EVAL.items():
        _add(ev, name, cmd, word(0) == "eval" and word(1) == name)
    args = parser.parse_args(argv)
    cmd = EVAL[args.what] if args.command == "eval" else COMMANDS[args.command]
    result = importlib.import_module(cmd.module).run(args)
    return result if isinstance(result, int) else 0  # the evaluations return their results, not a code


if __name__ == "__main__":
    sys.exit(main())
