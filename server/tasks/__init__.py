"""The training-task endpoints (/tasks): serving (TaskServing) and api_router."""
