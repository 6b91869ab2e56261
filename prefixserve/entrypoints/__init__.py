"""Ways in from outside the process, over HTTP: `server/`, the shell (the FastAPI app, auth and
roles, the request guard, admission, the tokenizer thread's fair queue, errors, metrics, the
operator routes and the inspector page), and two dialects that register their routes on it:
`openai/`, the OpenAI-compatible API, and `anthropic/`, the Messages API; `chat/` holds what both
dialects share about chats. `api_server.py` `build_app` puts the shell and the dialects together.

The arrows (tests/test_package_layout.py): `api_server.py` imports the shell and both dialects;
the dialects import the shell and `chat/`, never each other; the shell imports no dialect.
Knows an engine only through `engine/client.py` (`EngineClient`), its errors and its streams.
"""
