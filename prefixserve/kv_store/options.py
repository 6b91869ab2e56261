"""The disk tier's flags of `prefixserve serve` (vLLM-style names where vLLM has one) and the
`KVStoreConfig` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

import prefixserve.settings as settings
from prefixserve.kv_store import RETENTION_SECONDS, KVStoreConfig, capacity_from_gb


def add_kv_store_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-store-dir, --kv-store-gb, --no-kv-store, --kv-store-default-retention."""
    group = parser.add_argument_group("KV store (the prefix cache's disk tier)")
    group.add_argument(
        "--kv-store-dir",
        default=None,
        metavar="DIR",
        help="Directory of the disk tier, shared by the servers of one user on this host "
        f"(default: {settings.kv_store_root()}). Created 0700; its files are 0600.",
    )
    group.add_argument(
        "--kv-store-gb",
        type=float,
        default=None,
        metavar="GIB",
        help="Most disk the tier may use, over all models in the directory; least recently "
        "used blocks are deleted past it (default: a quarter of the free disk, at most 32).",
    )
    group.add_argument(
        "--no-kv-store",
        action="store_true",
        help="No disk tier: cached blocks live in the RAM pool only and die with the process.",
    )
    group.add_argument(
        "--kv-store-default-retention",
        choices=tuple(RETENTION_SECONDS),
        default="24h",
        help="Retention of a request without prompt_cache_retention: 24h writes its blocks to "
        "disk for up to 24 hours; in_memory never writes them.",
    )


def kv_store_config_from_args(args: argparse.Namespace) -> KVStoreConfig | None:
    """The KVStoreConfig the flags ask for, or None for no tier: --no-kv-store, or no store flag
    given while PREFIXSERVE_KV_STORE=0 turns the default off. ValueError names a bad value."""
    explicit = args.kv_store_dir is not None or args.kv_store_gb is not None
    if args.no_kv_store or not (explicit or settings.kv_store_default_enabled()):
        return None
    return KVStoreConfig(
        dir=None if args.kv_store_dir is None else Path(args.kv_store_dir),
        capacity_bytes=None if args.kv_store_gb is None else capacity_from_gb(args.kv_store_gb),
        default_retention=args.kv_store_default_retention,
    )
