"""Turning uploaded task datasets into skills: validation, job queue, training, keys, answer scoring."""
