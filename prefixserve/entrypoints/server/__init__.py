"""The HTTP server's shell, whose app includes the dialects' routers (`openai/`, `anthropic/`):
the app factory (`app.py` `build_shell`), the state every route shares and one request's
admission, streaming and collection (`state.py`), the guard before the body (`guard.py`: keys,
roles, body bounds), admission (`admission.py`), the tokenizer thread's fair queue
(`tokenizer_queue.py`), errors (`errors.py`, in each dialect's shape: `error_shape.py`), auth,
metrics, the served models, the operator routes (cache summary, pins, LoRA) and the inspector
page. Imports no dialect."""
