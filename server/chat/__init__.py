"""POST /v1/chat/completions: protocol (the request and response shapes), serving (ChatServing), api_router."""
