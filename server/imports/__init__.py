"""Adapters brought from outside (PEFT LoRA folders): POST /v1/skills/import and vLLM's load_lora_adapter and
unload_lora_adapter (serving and api_router), the places an adapter is read from (sources)."""
