"""The cache-wide summary operators read (`GET /v1/cache/summary`, the inspector page).

Built on demand from the pool's map and the recorder, in a few passes over the cached blocks
(linear in them), with every list bounded: the prefix tree keeps the `MAX_TREE_NODES` largest
nodes, `top_prefixes` the `TOP_PREFIXES` most reused of all nodes. Prefix text is decoded only
when the caller asks (`decode` given), at most `MAX_TEXT_TOKENS` tokens a node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.block import KVCacheBlock
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.kv_cache.reports.recorder import BlockRecorder

MAX_TREE_NODES = 300
MAX_TREE_DEPTH = 24
TOP_PREFIXES = 10
MAX_TEXT_TOKENS = 256
HASH_HEX_CHARS = 12


@dataclass(slots=True)
class _Node:
    """A run of cached blocks, each the only cached child of the one before (a radix trunk)."""

    blocks: list[KVCacheBlock]
    children: list[_Node] = field(default_factory=list)
    size: int = 0  # blocks in this node and below


def pool_summary(manager: KVCacheManager, recorder: BlockRecorder) -> dict[str, Any]:
    """Occupancy of the RAM pool: in use, cached, free, pinned, and cached blocks by tenant."""
    pool = manager.block_pool
    by_tenant: Counter[str | None] = Counter()
    namespace = recorder.namespace
    hash_to_block = pool.cached_block_hash_to_block[0]
    cached = len(hash_to_block)  # distinct cached hashes (a block computed twice is one)
    for _, blocks in hash_to_block.items():
        owner = namespace[blocks[0].block_id]
        by_tenant[owner.tenant if owner is not None else None] += 1
    in_use = manager.num_kv_blocks - manager.num_free_blocks
    return {
        "num_blocks": manager.num_kv_blocks,
        "in_use": in_use,
        "cached": cached,
        "free": manager.num_free_blocks,
        "pinned": manager.held.pins.num_blocks,
        "by_tenant": [
            {"tenant": tenant, "blocks": count}
            for tenant, count in sorted(by_tenant.items(), key=lambda kv: (-kv[1], str(kv[0])))
        ],
    }


def prefix_tree(
    manager: KVCacheManager,
    recorder: BlockRecorder,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the radix-style tree of cached prefixes, the most reused prefixes of all its nodes)."""
    roots, nodes = _build_nodes(manager, recorder)
    now = recorder.clock()
    budget = [MAX_TREE_NODES]
    render = _Render(manager.block_size, recorder, now, decode)
    tree = {
        "hash": "root",
        "blocks": 0,
        "tokens": 0,
        "hits": 0,
        "children": render.nodes(roots, budget, 0),
    }
    last = recorder.hits
    top = sorted(
        nodes,
        key=lambda n: (-last[n.blocks[-1].block_id], -recorder.depth[n.blocks[-1].block_id]),
    )[:TOP_PREFIXES]
    return tree, [render.node(n) for n in top]


def _build_nodes(
    manager: KVCacheManager, recorder: BlockRecorder
) -> tuple[list[_Node], list[_Node]]:
    """(the root nodes, every node)."""
    first: dict[bytes, KVCacheBlock] = {}
    for block_hash, blocks in manager.block_pool.cached_block_hash_to_block[0].items():
        first[block_hash] = blocks[0]
    children: dict[bytes | None, list[KVCacheBlock]] = {}
    parent_of = recorder.parent
    for block in first.values():
        parent = parent_of[block.block_id]
        if parent is not None and parent not in first:
            parent = None  # its parent was evicted: shown from the root
        children.setdefault(parent, []).append(block)
    # Iterative (a deep branching chain must not reach Python's recursion limit): nodes are
    # made parents first, so their sizes are summed children first by walking the list back.
    roots = [_Node([block]) for block in children.get(None, [])]
    made: list[_Node] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        made.append(node)
        while True:
            kids = children.get(node.blocks[-1].block_hash, [])
            if len(kids) != 1:
                break
            node.blocks.append(kids[0])
        node.children = [_Node([kid]) for kid in kids]
        stack.extend(node.children)
    for node in reversed(made):
        node.size = len(node.blocks) + sum(child.size for child in node.children)
    return roots, made


class _Render:
    """Nodes as the summary's dicts."""

    def __init__(
        self,
        block_size: int,
        recorder: BlockRecorder,
        now: float,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.block_size = block_size
        self.recorder = recorder
        self.now = now
        self.decode = decode

    def node(self, node: _Node) -> dict[str, Any]:
        recorder = self.recorder
        last = node.blocks[-1]
        owner = recorder.namespace[node.blocks[0].block_id]
        item: dict[str, Any] = {
            "hash": (node.blocks[0].block_hash or b"").hex()[:HASH_HEX_CHARS],
            "blocks": len(node.blocks),
            "tokens": (recorder.depth[last.block_id] + 1) * self.block_size,
            "hits": recorder.hits[last.block_id],
            "tenant": owner.tenant if owner is not None else None,
            "last_use_s_ago": round(
                max(0.0, self.now - max(recorder.last_use[b.block_id] for b in node.blocks)), 3
            ),
        }
        if self.decode is not None:
            tokens: list[int] = []
            for block in node.blocks:
                tokens.extend(block.token_ids or ())
                if len(tokens) >= MAX_TEXT_TOKENS:
                    break
            item["text"] = self.decode(tokens[:MAX_TEXT_TOKENS])
        return item

    def nodes(self, nodes: list[_Node], budget: list[int], depth: int) -> list[dict[str, Any]]:
        """`nodes` at `depth` levels below the root's children (0: the root's own); their
        children down to MAX_TREE_DEPTH levels below the root in all."""
        out = []
        for node in sorted(nodes, key=lambda n: -n.size):
            if budget[0] <= 0:
                break
            budget[0] -= 1
            item = self.node(node)
            item["children"] = (
                self.nodes(node.children, budget, depth + 1) if depth + 1 < MAX_TREE_DEPTH else []
            )
            out.append(item)
        return out


def window_rates(recorder: BlockRecorder) -> dict[str, Any]:
    """Prompt tokens queried and hit over the last 60 and 300 s with the hit rates, and the
    evictions: {"hit_rate", "window_tokens", "eviction"} (the tokens let replicas' summaries
    combine)."""
    hit_rate: dict[str, Any] = {}
    tokens: dict[str, Any] = {}
    per_s = 0.0
    for seconds in (60, 300):
        queries, hits, evictions = recorder.window.totals(seconds)
        key = f"{seconds}s"
        hit_rate[key] = round(hits / queries, 4) if queries else None
        tokens[key] = {"queries": queries, "hits": hits}
        if seconds == 60:
            per_s = evictions / 60.0
    return {
        "hit_rate": hit_rate,
        "window_tokens": tokens,
        "eviction": {"total": recorder.num_evicted, "per_s_60s": round(per_s, 4)},
    }
