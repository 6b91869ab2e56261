"""The blocks every family is built of: linears and their paths per CPU (`linear.py`), norms and
the gated MLP (`common.py`), attention over the paged KV cache (`attention.py`), rotary
embeddings (`rotary.py`), the compiled kernels they call (`kernel_table.py`).

May import `model/kernels/` and `model/config.py`.
"""
