"""The OpenAI-compatible HTTP server: the app factory (`app.py`), the guard before the body
(`guard.py`: keys, roles, body bounds), admission (`admission.py`), the tokenizer thread's fair
queue (`tokenizer_queue.py`), protocol models, the completions and chat routes, errors, auth,
metrics, the operator routes (cache summary, pins, LoRA) and the inspector page."""
