"""Request routing: embed the routed text, retrieve skill keys, turn scores into a LoRA mix."""
from .router import Decision, Router, RouterSettings

__all__ = ["Decision", "Router", "RouterSettings"]
