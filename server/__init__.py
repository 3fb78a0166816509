"""The HTTP server: OpenAI-compatible API, batching scheduler, engines, CLI, config and metrics."""
