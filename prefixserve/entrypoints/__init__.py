"""Ways in from outside the process, over HTTP: `openai/`, the OpenAI-compatible server (the app,
auth and roles, the request guard, admission, the tokenizer thread's fair queue, errors,
metrics, the operator routes and the inspector page), and `anthropic/`, the Messages API over
the same app; `error_shape.py` says which dialect's error shape a route answers in.

Knows an engine only through `engine/client.py` (`EngineClient`), its errors and its streams.
"""
