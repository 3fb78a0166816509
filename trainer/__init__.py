"""Turning uploaded task datasets into skills: validation, training, keys, answer scoring; the job machinery
in trainer.jobs, the skill-event bus in trainer.bus, and what a server takes of it all in trainer.service."""
