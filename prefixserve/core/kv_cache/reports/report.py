"""The cache report of one request: tokens per tier and why its first missed block missed.

`REASONS` is the fixed, documented vocabulary (docs/cache_reports.md); every request gets exactly
one, since at least its last token is always computed:

- `cache_disabled`: prefix caching is off, or the request skips reading the cache;
- `last_token_rule`: every full block hit but the last, which is cached too but holds the prompt's
  last token (always computed, for its logits);
- `not_full_block`: every full block hit; the rest is a tail shorter than a block (never cached);
- `in_flight_wait`: the request waited for another request's prefill of its next blocks, then hit;
- `disk_load_skipped`: the disk tier holds the block, but loading was measured slower than
  computing;
- `expired`: the disk tier held the block, past its retention;
- `tier_fault`: the shared tier (`--kv-remote`) could not answer for the block (down, timed out,
  refused: `detail.fault` "unreachable") or held a damaged value for it ("bad_value"); the
  block was computed (`detail.tier`: "remote");
- `evicted`: the pool held the block and evicted it (`detail`: how long ago, by which policy);
- `salt_or_tenant` / `adapter`: the same prefix is cached under another cache salt / another LoRA
  adapter of the same tenant (never another tenant's: that is `never_seen`; without tenants, a
  salt is a client's own namespace, so only `adapter` is looked for);
- `other_kv_dtype`: the disk tier or the shared tier holds the block as an engine with another
  `--kv-cache-dtype` stored it (`detail.kv_dtype`), which this engine cannot read;
- `never_seen`: none of the above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONS: tuple[str, ...] = (
    "cache_disabled",
    "last_token_rule",
    "not_full_block",
    "in_flight_wait",
    "disk_load_skipped",
    "expired",
    "tier_fault",
    "evicted",
    "salt_or_tenant",
    "adapter",
    "other_kv_dtype",
    "never_seen",
)


@dataclass(slots=True)
class CacheReport:
    """Where one request's prompt tokens came from, and why the first block after its hit was
    not served from the cache. `first_miss_block` is None for `cache_disabled`.
    `remote_tokens` is None on an engine without a shared tier (the JSON then has no
    `tokens.remote`)."""

    block_size: int
    prompt_tokens: int
    hit_blocks: int
    ram_tokens: int
    disk_tokens: int
    reason: str
    first_miss_block: int | None
    detail: dict[str, Any] = field(default_factory=dict)
    remote_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown cache-miss reason {self.reason!r}")

    @property
    def prompt_full_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    @property
    def cached_tokens(self) -> int:
        """Tokens served from any tier: RAM, disk and shared."""
        return self.ram_tokens + self.disk_tokens + (self.remote_tokens or 0)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def tokens(self) -> dict[str, int]:
        """Prompt tokens by where they came from: "ram", "disk", "remote" (only with a shared
        tier), "computed"."""
        tokens = {"ram": self.ram_tokens, "disk": self.disk_tokens}
        if self.remote_tokens is not None:
            tokens["remote"] = self.remote_tokens
        tokens["computed"] = self.computed_tokens
        return tokens

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape clients get (the server's and `RequestOutput`'s `cache_report`)."""
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "prompt_full_blocks": self.prompt_full_blocks,
            "hit_blocks": self.hit_blocks,
            "tokens": self.tokens(),
            "reason": self.reason,
            "first_miss_block": self.first_miss_block,
            "detail": dict(self.detail),
        }


# What each reason means, in the words `describe_report` uses.
REASON_TEXT = {
    "cache_disabled": "prefix caching is off for it",
    "last_token_rule": "it holds the prompt's last token, which is always computed",
    "not_full_block": "it is not a full block (only full blocks are cached)",
    "in_flight_wait": "another request was computing it; this one waited, then hit",
    "disk_load_skipped": "the disk tier holds it, but loading was measured slower than computing",
    "expired": "the disk tier's copy is past its retention",
    "tier_fault": "the shared tier could not serve it (unreachable, or a damaged value)",
    "evicted": "it was cached and evicted",
    "salt_or_tenant": "it is cached under another cache salt of yours",
    "adapter": "it is cached under another LoRA adapter (or without one)",
    "other_kv_dtype": "a tier holds it in another KV cache dtype (--kv-cache-dtype)",
    "never_seen": "no cached prompt has it",
}


def describe_report(report: CacheReport) -> str:
    """One sentence: "this prompt would hit 1,024 of 1,100 tokens; block 64 (tokens
    1,024-1,039) misses: it was cached and evicted (12.3 s ago, lru); it differs from the cached
    one at token 1,031" (blocks and tokens counted from 0, as in the report)."""
    text = f"this prompt would hit {report.cached_tokens:,} of {report.prompt_tokens:,} tokens"
    if report.disk_tokens or report.remote_tokens:
        text += f" ({report.ram_tokens:,} from RAM, {report.disk_tokens:,} from disk"
        if report.remote_tokens is not None:
            text += f", {report.remote_tokens:,} from the shared tier"
        text += ")"
    block = report.first_miss_block
    if block is None:
        return f"{text}: {REASON_TEXT[report.reason]}"
    start = block * report.block_size
    end = min(start + report.block_size, report.prompt_tokens) - 1
    text += f"; block {block} (tokens {start:,}-{end:,}) misses: {REASON_TEXT[report.reason]}"
    detail = report.detail
    if "ago_s" in detail:
        text += f" ({detail['ago_s']:.1f} s ago, {detail['policy']})"
    if "differs_at_token" in detail:
        text += f"; it differs from the cached one at token {detail['differs_at_token']:,}"
    return text
