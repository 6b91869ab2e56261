"""The serving comparison harness: prefixserve, vLLM's CPU build and llama.cpp started one after
another as servers (servers.py), driven by prefixserve's benchmark client on the same workloads
(compare.py), with one figure per workload (plots.py).

It lives in the checkout, not in the installed package, and needs the `bench` extra (httpx,
matplotlib): `prefixserve bench compare ...` from an editable install, or
`python -m benchmarks.serving ...` (the same flags) in the checkout's root.
"""
