"""The OpenAI-compatible HTTP server: app factory, protocol models, errors, auth, metrics."""
