"""POST /v1/completions (OpenAI's legacy completions): protocol, serving (CompletionServing), api_router."""
