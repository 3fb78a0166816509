"""OpenAI's fine-tuning surface over the skill trainer: files, jobs (events, checkpoints), in the layout of
vLLM's entrypoints/openai: per resource a protocol (pydantic shapes), a serving part (logic) and an
APIRouter. Jobs are the same records and queue as /tasks; only their face is OpenAI's."""
