"""What a failed job tells its user: a machine-readable code and a message with no internal paths.

The full exception (paths, traceback) goes to the server log; the job record, which any caller that can read
the job sees, gets the code and a message with every absolute path cut to its last part.
"""

from __future__ import annotations

import errno
import re

from skillpool.adapters_store.diskio import FULL_ERRNOS

# an absolute path of two or more parts, not inside a word, a URL or a relative path
_PATH = re.compile(r"(?<![\w.~/:-])/(?:[^\s/'\"`]+/)+([^\s/'\"`]*)")
_FULL_TEXTS = {
    "No space left on device": errno.ENOSPC,
    "StorageFull": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
}


def redact_paths(text: str) -> str:
    """Every absolute path in `text` cut to its last part ('/data/skills/x/v1/meta.json' → 'meta.json')."""
    return _PATH.sub(lambda m: m.group(1) or "…", text)


def storage_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when `exc` or an exception it came from says the disk is full (safetensors and torch
    report it in their message only), else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e.errno
        text = str(e)
        for needle, code in _FULL_TEXTS.items():
            if needle in text:
                return code
        e = e.__cause__ or e.__context__
    return None


def describe(exc: BaseException, doing: str = "saving the skill") -> tuple[str, str]:
    """(code, message) for a job that raised `exc` while `doing` what it did."""
    if storage_errno(exc) is not None:
        return "insufficient_storage", f"no space left on device (disk full or quota reached) while {doing}"
    return "training_error", redact_paths(f"{type(exc).__name__}: {exc}")
