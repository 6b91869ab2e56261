"""The blocks every family is built of: linears, norms and the gated MLP (`common.py`),
attention over the paged KV cache (`attention.py`), rotary embeddings (`rotary.py`).

May import `model/kernels/` and `model/config.py`.
"""
