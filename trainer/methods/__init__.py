"""The training methods as classes behind one interface (base.TrainingMethod), chosen by name (method_for).

  isolated  a fresh LoRA block trained on the task alone (isolated.py).
  kif       Recurrent-KIF: the block starts from similar earlier blocks where that helps and trains in
            cycles on the task and a memory buffer of earlier skills (kif.py, its start in kif_start.py).
  sapt      SAPT attentive learning: the block trains inside the attention mix of every earlier block with its
            router key and the query projector (sapt.py); needs the router in sapt mode.
All three run on one training loop (trainer/loop.py), each with its own hooks on it.
"""

from __future__ import annotations

from ..config import METHODS
from .base import BlockJob, TrainedBlock, TrainingMethod
from .isolated import IsolatedMethod
from .kif import KIFMethod
from .sapt import SAPTMethod

__all__ = ["METHOD_CLASSES", "BlockJob", "TrainedBlock", "TrainingMethod", "method_class", "method_error", "method_for"]

METHOD_CLASSES: dict[str, type[TrainingMethod]] = {m.name: m for m in (IsolatedMethod, SAPTMethod, KIFMethod)}
assert tuple(METHOD_CLASSES) == METHODS, "every name in METHODS needs its class here"


def method_class(name: str) -> type[TrainingMethod]:
    """The class of a method name; a ValueError naming the known ones for any other."""
    try:
        return METHOD_CLASSES[name]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(METHOD_CLASSES)}, got {name!r}") from None


def method_error(method: str, router_mode: str) -> str | None:
    """Why `method` cannot train under a router in `router_mode`, or None when it can."""
    try:
        return method_class(method).router_error(router_mode)
    except ValueError as e:
        return str(e)


def method_for(name: str) -> TrainingMethod:
    return method_class(name)()
