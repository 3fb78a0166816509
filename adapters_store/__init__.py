"""Skill records on disk, adapter files, base-model resolution and the LoRA mix math.

Nothing outside this package knows the on-disk layout of a skill or how LoRA factors combine.
"""
