"""Serving benchmarks: a streaming OpenAI client, workloads W0–W3, and side-by-side runs of
prefixserve, vLLM's CPU build and llama.cpp (`prefixserve bench ...`)."""
