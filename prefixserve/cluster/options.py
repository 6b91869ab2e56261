"""The replica flags of `prefixserve serve`, and starting the engine they ask for.

`--replicas 1` (the default) and no `--ray-address` serve from one in-process engine, as
always; otherwise the engine replicas run on Ray behind the same server (`ray_cluster.py`).
Importing this module does not import Ray.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The deployment's flags (the replicas' count, threads and routing policy are engine
    options: `engine_args.EngineArgs`)."""
    group = parser.add_argument_group("replicas (Ray)")
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="Join this Ray cluster (made with `ray start --head` and `ray start --address`) "
        "instead of starting a local Ray runtime; replicas then spread over its hosts.",
    )
    group.add_argument(
        "--ray-namespace",
        default="prefixserve",
        metavar="NAME",
        help="With --ray-address: the Ray namespace of this deployment's replicas (detached "
        "actors named prefixserve-replica-<i>). A server started again with the same address and "
        "namespace adopts the replicas its predecessor left running, with their warm caches.",
    )
    group.add_argument(
        "--keep-replicas",
        action="store_true",
        help="With --ray-address: leave the replicas running when this server stops cleanly "
        "(for a planned restart of the front); a crashed server always leaves them.",
    )
    group.add_argument(
        "--replace-replicas",
        action="store_true",
        help="With --ray-address: stop replicas an earlier server left that were started with "
        "another configuration, or beyond --replicas, instead of refusing to start.",
    )
    group.add_argument(
        "--max-in-flight-per-replica",
        type=int,
        default=None,
        metavar="N",
        help="A replica with this many requests in flight is skipped while another is below "
        "it. Default: no cap.",
    )
    group.add_argument(
        "--drop-event-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="Testing: drop this fraction of the replicas' event batches on arrival (the "
        "router must notice and recover).",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    return args.num_replicas != 1 or args.ray_address is not None


def start_cluster_from_args(args: argparse.Namespace, config: Any) -> Any:
    """The ClusterEngine the flags describe (ValueError for bad values)."""
    if not 0.0 <= args.drop_event_fraction < 1.0:
        raise ValueError(f"--drop-event-fraction must be in [0, 1), got {args.drop_event_fraction}")
    if args.max_in_flight_per_replica is not None and args.max_in_flight_per_replica < 1:
        raise ValueError("--max-in-flight-per-replica must be at least 1")
    from prefixserve.cluster.ray_cluster import start_cluster

    return start_cluster(
        config,
        args.num_replicas,
        threads_per_replica=args.threads_per_replica,
        ray_address=args.ray_address,
        ray_namespace=args.ray_namespace,
        keep_replicas=args.keep_replicas,
        replace_replicas=args.replace_replicas,
        routing_policy=args.routing_policy,
        max_in_flight_per_replica=args.max_in_flight_per_replica,
        drop_event_fraction=args.drop_event_fraction,
        collect_kv_events=args.enable_kv_events,
    )
