"""LoRA math: adapters and their PEFT files, the `Mix` value, the mixed layer, serving's bank with its batch plans,
training's weighted mix and dropout, and a mix written as one concatenated adapter."""
