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

Router restarts. With `ray_address` the replicas are detached, named actors
(`prefixserve-replica-<i>` in `ray_namespace`): they outlive the server's process. A server that
starts with the same address and namespace finds them, checks they were started with the same
configuration (else refuses, or with `replace_replicas` stops them and starts new ones), adopts
them with their warm caches and rebuilds its index from each one's snapshot (event_feed.py). A
crashed server's replicas are thus reattached; a clean stop stops them too, unless
`keep_replicas` (a planned restart of the front). A local Ray runtime lives in the server's
process, so there a router restart is a restart of everything.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import time
from typing import Any

import prefixserve.settings as settings
from prefixserve.cluster.client import ClusterEngine
from prefixserve.cluster.messages import RegistrationError
from prefixserve.cluster.policy import DEFAULT_POLICY, make_policy
from prefixserve.cluster.replica import EngineReplica, config_digest
from prefixserve.cluster.router import Router
from prefixserve.config import EngineConfig
from prefixserve.model.loader.loading import read_model_info, resolve_dtype, resolve_model_dir

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 256 << 20
ACTOR_NAMESPACE = "prefixserve"
REPLICA_PREFIX = "prefixserve-replica-"
NAME_RELEASE_TIMEOUT_S = 30.0
ADOPT_TIMEOUT_S = 120.0  # a replica still loading its model answers within this
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def start_cluster(  # noqa: C901, PLR0915 - start-up in order: Ray, adoption of earlier replicas, new ones, registration
    config: EngineConfig,
    num_replicas: int,
    *,
    threads_per_replica: int = 1,
    ray_address: str | None = None,
    ray_namespace: str = ACTOR_NAMESPACE,
    detached: bool | None = None,
    keep_replicas: bool = False,
    replace_replicas: bool = False,
    routing_policy: str = DEFAULT_POLICY,
    max_in_flight_per_replica: int | None = None,
    drop_event_fraction: float = 0.0,
    collect_kv_events: bool = False,
    seed: int | None = None,
) -> ClusterEngine:
    """Start (or join) Ray, start the replicas (or adopt running ones: `detached`, the default
    with `ray_address`), register them; raises ValueError for bad arguments and
    RegistrationError for replicas that cannot be routed together."""
    if ray_address:
        settings.use_ray_cluster_token()  # read when Ray is first imported
    import ray

    if num_replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
    if threads_per_replica < 1:
        raise ValueError(f"--threads-per-replica must be at least 1, got {threads_per_replica}")
    if not _NAMESPACE.match(ray_namespace):
        raise ValueError(
            f"--ray-namespace must be 1-64 letters, digits, '_', '.' or '-', got {ray_namespace!r}"
        )
    detached = ray_address is not None if detached is None else detached
    if keep_replicas and not detached:
        raise ValueError(
            "--keep-replicas needs --ray-address: a local Ray runtime ends with this process"
        )
    policy = make_policy(routing_policy, seed)
    model_dir = resolve_model_dir(config.model)
    model = read_model_info(model_dir, resolve_dtype(config.dtype), config.max_model_len)
    cache = dataclasses.replace(config.cache, enable_kv_events=True)
    replica_config = dataclasses.replace(config, model=str(model_dir), cache=cache)
    started_ray = False
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, namespace=ray_namespace, log_to_driver=False)
        else:
            ray.init(
                num_cpus=num_replicas * threads_per_replica,
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
                namespace=ray_namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            started_ray = True
    found: dict[int, Any] = {}
    if detached:
        digest = config_digest(replica_config, threads_per_replica)
        found = _adopt(num_replicas, ray_namespace, digest, replace_replicas)
    hash_seed = ray.get(next(iter(found.values())).hash_seed.remote()) if found else None
    env = {
        "OMP_NUM_THREADS": str(threads_per_replica),
        "PYTHONHASHSEED": hash_seed or str(secrets.randbelow(2**32)),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    options: dict[str, Any] = {
        "num_cpus": threads_per_replica,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": 4096,
        "runtime_env": {"env_vars": env},
    }
    handles = []
    for i in range(num_replicas):
        if i in found:
            handles.append(found[i])
            continue
        if detached:
            names = {"name": f"{REPLICA_PREFIX}{i}", "namespace": ray_namespace}
            options.update(names, lifetime="detached")
        actor = ray.remote(EngineReplica).options(**options)
        handles.append(actor.remote(i, replica_config, threads=threads_per_replica))
    if found:
        logger.info(
            "adopted %d running replica(s) in Ray namespace %r: the router rebuilds its index "
            "from their snapshots",
            len(found),
            ray_namespace,
        )

    def stop() -> None:
        if not (detached and keep_replicas):
            for handle in handles:
                _kill(handle)
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
        collect_kv_events=collect_kv_events,
        on_stop=stop,
    )
    try:
        engine.start()
    except BaseException:
        stop()
        raise
    return engine


def _adopt(num_replicas: int, namespace: str, digest: str, replace: bool) -> dict[int, Any]:
    """The replicas an earlier server left running in `namespace` that this one can use, by
    index. Ones started with another configuration, or beyond `num_replicas`, are stopped with
    `replace`, else refused (RegistrationError: the operator decides)."""
    import ray

    found: dict[int, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry.get("name", "")
        index = name.removeprefix(REPLICA_PREFIX)
        if entry.get("namespace") != namespace or index == name or not index.isdigit():
            continue
        handle = ray.get_actor(name, namespace=namespace)
        try:
            info = ray.get(handle.info.remote(), timeout=ADOPT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RegistrationError(
                f"replica {name} in Ray namespace {namespace!r} did not answer within "
                f"{ADOPT_TIMEOUT_S:.0f} s (a host down?); stop it or use another --ray-namespace"
            ) from None
        problem = None
        if int(index) >= num_replicas:
            problem = f"is beyond --replicas {num_replicas}"
        elif info.config_digest != digest:
            problem = "was started with another configuration (model, cache, threads...)"
        if problem is None:
            found[int(index)] = handle
        elif replace:
            logger.warning("stopping replica %s of an earlier server: it %s", name, problem)
            _kill(handle)
            _wait_released(name, namespace)
        else:
            raise RegistrationError(
                f"replica {name} in Ray namespace {namespace!r}, left by an earlier server, "
                f"{problem}; start with --replace-replicas to stop it, or another --ray-namespace"
            )
    return found


def _kill(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _wait_released(name: str, namespace: str) -> None:
    """Until a killed named actor's name is free again (Ray frees it once the actor is dead)."""
    import ray

    deadline = time.monotonic() + NAME_RELEASE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    raise RegistrationError(f"replica {name} did not stop within {NAME_RELEASE_TIMEOUT_S:.0f} s")


def replica_pids(engine: ClusterEngine) -> list[int]:
    """Each replica's process id (tests kill one)."""
    import ray

    return list(ray.get([h.pid.remote() for h in engine.handles]))


def kill_replica(engine: ClusterEngine, replica_id: int) -> Any:
    """Kill one replica's process as a crash would (Ray restarts it)."""
    import ray

    ray.kill(engine.handles[replica_id], no_restart=False)
