"""Speculative decoding: draft tokens proposed without a draft model, verified in one forward pass.

`prefixserve/config.py` holds the engine option (vLLM's `speculative_config` JSON), `ngram.py`
the proposer (prompt lookup: the tokens that followed the last n-gram's latest earlier
occurrence); its counters' derived rates are the scheduler's (`core/sched/spec_metrics.py`).
The runner's side (the rows a request's drafts add to the sampler, and which drafts the sampled
tokens accept) lives with the sampler, in `worker/sample/verify.py`. Nothing here caches or
hashes a draft: the scheduler allocates their slots as lookahead
(`KVCacheManager.allocate_slots(num_lookahead_tokens=...)`), which is never cached, and a draft
joins the sequence only once the target model has sampled it.
"""

from prefixserve.config import SpeculativeConfig, speculative_config_from

__all__ = ["SpeculativeConfig", "speculative_config_from"]
