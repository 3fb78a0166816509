"""How every skillpool process that runs torch sets itself up, in one place: `skillpool serve`, `skillpool worker`,
each Ray Serve replica, and the command dispatcher before any of them loads torch.

- `PROCESS_ENV`: OpenMP's idle threads spin briefly, then sleep (openmp.py); no tokenizer thread pools beside
  torch's; models only from installed packages and local folders (no hub). A Ray worker's environment gets the
  same variables, since it does not start through the dispatcher.
- `setup_process`: those variables (a value the user set wins), logging at the given level, and torch's threads
  (--threads).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from .openmp import openmp_defaults, set_openmp_defaults
from .threads import set_threads

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def process_env() -> dict[str, str]:
    """The variables every skillpool process runs with, unless the user set them."""
    return {**openmp_defaults(), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def set_process_env(env: MutableMapping[str, str] = os.environ) -> None:
    """Before torch loads (OpenMP reads its variables once)."""
    set_openmp_defaults(env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")


def setup_process(threads: int | None, log_level: str | None = "info") -> None:
    """A serving or training process' set-up: its environment, its log level (None: leave logging as it is) and
    torch's threads (None: torch's default, every core)."""
    set_process_env()
    if log_level is not None:
        logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    set_threads(threads)
