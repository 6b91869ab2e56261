"""Serving benchmarks, the client side: a streaming OpenAI client, the seeded workloads W0–W3,
summaries and result tables (`prefixserve bench run|report`; needs the `bench` extra). Running
prefixserve beside vLLM's CPU build and llama.cpp (`prefixserve bench compare`) and the figures
are the checkout's benchmarks/serving/."""
