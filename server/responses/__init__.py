"""POST /v1/responses (OpenAI's Responses API, stateless): protocol, serving (ResponsesServing), api_router."""
