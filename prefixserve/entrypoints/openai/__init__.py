"""The OpenAI dialect on the server's shell (`server/`): its routes (`routes.py`: /v1/models,
/v1/completions, /v1/chat/completions), protocol models (`protocol.py`, `tool_protocol.py`), the
completions and chat handlers, the responses' views (`serving.py`), tool calls, structured
outputs and prompt embeddings off the wire. Imports the shell and `chat/`, never `anthropic/`."""
