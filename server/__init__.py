"""The HTTP server: OpenAI-compatible API, routing stage, engines, CLI, config and metrics."""
