"""Exact per-request skill mixes inside vLLM's LoRA layers: resident skills, per-token (slot, weight) pairs."""
