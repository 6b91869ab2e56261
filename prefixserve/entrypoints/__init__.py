"""Ways in from outside the process: `openai/`, the OpenAI-compatible HTTP server."""
