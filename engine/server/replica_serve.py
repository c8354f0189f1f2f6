"""Start the replicas behind Ray Serve's HTTP proxy, and stop them: ``serve --replicas N``.

Apart from :mod:`engine.server.replicas` (a replica) and :mod:`engine.server.replica_front`
(the front that routes to them), so that each of those two imports only downward:
the front reads the replicas' constants, and this module deploys both.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from engine.network import is_loopback
from engine.server.replica_front import Front
from engine.server.replicas import MAX_ONGOING, RAY_LOCAL_ONLY_ENV, EngineReplica, JobAffinityRouter
from engine.server.settings import ServerSettings


def deploy(
    settings: ServerSettings, *, load: str | None, replicas: int = 2, autoscaling: dict[str, Any] | None = None,
    address: str | None = None, host: str = "127.0.0.1", port: int = 8000, ray_init: dict[str, Any] | None = None,
) -> None:
    """Start (or join, ``address``) Ray, and run the two deployments behind Ray Serve's HTTP proxy
    on ``host:port``. Returns once every replica is up; :func:`shutdown` stops them."""
    import ray
    from ray.serve.config import RequestRouterConfig

    global _own_ray
    if not ray.is_initialized():
        options = dict(ray_init or {})
        if address is None and is_loopback(host):
            _ray_on_loopback()
            options.setdefault("include_dashboard", False)
        ray.init(address=address, **options)
        _own_ray = address is None
    serve.start(http_options={"host": host, "port": port})
    per_replica = {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) >= 1 else {"num_cpus": 1}
    scale: dict[str, Any] = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", ray_actor_options=per_replica, max_ongoing_requests=MAX_ONGOING,
        request_router_config=RequestRouterConfig(request_router_class=JobAffinityRouter),
        health_check_period_s=2, **scale,
    )
    front = serve.deployment(Front, name="Front", num_replicas=1,
                             ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING)
    serve.run(front.bind(replica.bind(settings, load), settings), name="diffusion-engine", route_prefix="/")


def _ray_on_loopback() -> None:
    """Make the Ray about to start here a loopback-only one (see the module docstring): the
    switch in the environment for the processes Ray starts, and in this process's Ray."""
    from ray._private import ray_constants

    os.environ[RAY_LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


#: Ray was started here by :func:`deploy` (not joined): stopping it stops the deployments too.
_own_ray = False


def shutdown() -> None:
    """Stop the deployments: a Ray started here is stopped whole (its replicas with it, at
    once); on a cluster joined with ``address`` the application is removed, and Ray keeps running."""
    import ray

    if not _own_ray:
        serve.shutdown()
    ray.shutdown()
