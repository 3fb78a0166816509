"""Request routing: embed the routed text, retrieve skill keys, turn scores into a LoRA mix."""

from .router import MODES, Decision, Features, Router, RouterSettings
from .sapt import SAPTSettings, TokenPooler

__all__ = ["MODES", "Decision", "Features", "Router", "RouterSettings", "SAPTSettings", "TokenPooler"]
