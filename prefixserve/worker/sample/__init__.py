"""Sampling, in one room as vLLM's v1 sample package: `sampler.py` (penalties, temperature, top-k/p,
min-p, logprobs) and `verify.py` (speculative decoding's verification rows and how many drafts
the sampled tokens accept). Imports `core/` records only; `worker/model_runner.py` uses both.
"""
