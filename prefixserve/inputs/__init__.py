"""What a request brings besides token ids, in the form every room above reads it (vLLM's
`inputs/`): `prompt_embeds.py`, prompt embeddings (checks, the bits a Request keeps, the rows a
step feeds the model).

Below both the engine (which checks and keeps them) and the worker (which feeds them to the
model); may import `model/config.py` and the public records (`sampling_params.py`), nothing of
the engine, the worker or the server.
"""
