"""Starting replicas on Ray: a local Ray runtime (or a cluster's), one actor per replica.

`start_cluster(config, num_replicas, ...)` returns a `ClusterEngine` whose replicas are Ray
actors of `EngineReplica`, each with `threads_per_replica` CPUs (Ray schedules them on hosts with
free CPUs: several hosts when `ray_address` names a cluster), restarted by Ray when they die.

Without `ray_address` a local Ray runtime is started in this process (no dashboard, a small
object store: replicas exchange small records, never tensors of K/V), and stopped with the
cluster. With it (`ray start --head` on one host, `ray start --address HEAD:6379` on the others,
then `prefixserve serve --replicas N --ray-address HEAD:6379`), the replicas join that cluster;
every host needs the same prefixserve install and the model.

All replicas chain their block hashes from one seed: a shared KV store's (its seed file), else
one this function draws and hands them in PYTHONHASHSEED, so the router's registration check
(one seed fingerprint) holds and their stores could be shared later.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any

from prefixserve.cluster.client import ClusterEngine
from prefixserve.cluster.policy import DEFAULT_POLICY, make_policy
from prefixserve.cluster.replica import EngineReplica
from prefixserve.cluster.router import Router
from prefixserve.config import EngineConfig
from prefixserve.model.loader import read_model_info, resolve_dtype, resolve_model_dir

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 256 << 20
ACTOR_NAMESPACE = "prefixserve"


def start_cluster(
    config: EngineConfig,
    num_replicas: int,
    *,
    threads_per_replica: int = 1,
    ray_address: str | None = None,
    routing_policy: str = DEFAULT_POLICY,
    max_in_flight_per_replica: int | None = None,
    drop_event_fraction: float = 0.0,
    seed: int | None = None,
) -> ClusterEngine:
    """Start (or join) Ray, start the replicas, register them; raises ValueError for bad
    arguments and RegistrationError for replicas that cannot be routed together."""
    import ray

    if num_replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
    if threads_per_replica < 1:
        raise ValueError(f"--threads-per-replica must be at least 1, got {threads_per_replica}")
    policy = make_policy(routing_policy, seed)
    model_dir = resolve_model_dir(config.model)
    model = read_model_info(model_dir, resolve_dtype(config.dtype), config.max_model_len)
    cache = dataclasses.replace(config.cache, enable_kv_events=True)
    replica_config = dataclasses.replace(config, model=str(model_dir), cache=cache)
    started_ray = False
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, namespace=ACTOR_NAMESPACE, log_to_driver=False)
        else:
            ray.init(
                num_cpus=num_replicas * threads_per_replica,
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
                namespace=ACTOR_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            started_ray = True
    env = {
        "OMP_NUM_THREADS": str(threads_per_replica),
        "PYTHONHASHSEED": str(secrets.randbelow(2**32)),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    actor = ray.remote(EngineReplica).options(
        num_cpus=threads_per_replica,
        max_restarts=-1,
        max_task_retries=0,
        max_concurrency=4096,
        runtime_env={"env_vars": env},
    )
    handles = [
        actor.remote(i, replica_config, threads=threads_per_replica) for i in range(num_replicas)
    ]

    def stop() -> None:
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if started_ray:
            ray.shutdown()

    block_size = config.cache.block_size
    router = Router(
        block_size,
        config.cache.prefix_caching_hash_algo,
        policy,
        max_in_flight=max_in_flight_per_replica,
    )
    engine = ClusterEngine(
        handles,
        model,
        replica_config,
        router,
        drop_event_fraction=drop_event_fraction,
        on_stop=stop,
    )
    try:
        engine.start()
    except BaseException:
        stop()
        raise
    return engine


def replica_pids(engine: ClusterEngine) -> list[int]:
    """Each replica's process id (tests kill one)."""
    import ray

    return list(ray.get([h.pid.remote() for h in engine.handles]))


def kill_replica(engine: ClusterEngine, replica_id: int) -> Any:
    """Kill one replica's process as a crash would (Ray restarts it)."""
    import ray

    ray.kill(engine.handles[replica_id], no_restart=False)
