"""Serving replicas on Ray Serve: one ``Engine`` per replica, behind the same HTTP API and web page.

``serve --replicas N`` (``--ray-address`` for an existing Ray cluster) deploys two
Ray Serve deployments instead of the single-process server:

- ``EngineReplica``: N replicas (or Ray Serve's own ``autoscaling_config``, given as
  ``--ray-autoscaling JSON``), each with ``num_gpus=1`` on a GPU machine (``num_cpus=1``
  on a CPU) so Ray places one per device. Each holds one ``Engine`` (loading
  ``--load MODEL`` at start) and runs the single-process server's app on a loopback
  port of its own node: the same routes, the same preflights before its device is
  touched, the same job queue, 429 and SSE. Its name ends every job id it makes.
- ``Front`` (one replica): Ray Serve's HTTP proxy hands it every request; it passes
  each to a replica through a ``DeploymentHandle``, streaming the event routes.

Routing is Ray Serve's request router, told one thing (:class:`JobAffinityRouter`):
a request about a job (``/v1/images/jobs/{id}``, its events, its cancel) goes to the
replica whose name ends the id, so a job is owned by one replica and following or
cancelling it reaches that replica. Anything else goes to the replica with room; a
new job one replica refuses with 429 is offered to the others before the client
gets the 429. A replica that dies is replaced by Ray Serve; a request about a job
it owned is answered by another replica: the job failed with its replica
(``replica_lost``), and the service keeps answering.

Routes that would change one replica's state and split the service (loading or
unloading a model, training) are refused with ``not_with_replicas``: a replicated
service serves its ``--load`` model; train with ``train`` (``--nodes`` across machines).

Local means local: a Ray that ``serve`` starts itself for a loopback ``--host``
runs as Ray runs on a laptop, its node address the loopback one, so its own
servers (GCS, raylet, workers, agents) listen on loopback only and the dashboard
is off. Joined to a cluster (``--ray-address``) or serving beyond loopback, Ray's
ports (GCS 6379, the raylet's, the object manager's and one per worker; see
Ray's security docs) listen on the node's address: a trusted network only,
since Ray authenticates nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.request_router import RequestRouter

from engine.network import free_loopback_port
from engine.server.settings import ServerSettings

#: Ray's switch for a machine that is not part of a cluster: its node address is then the
#: loopback one, and every server Ray starts binds that address (read by each Ray process).
RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

#: A job's routes: ``/v1/images/jobs/{id}`` and below; the id ends with ``.REPLICA``.
JOB_PATH = re.compile(r"^/v1/images/jobs/(?P<id>[^/]+?)(?:/events)?$")
#: Routes that would change one replica's state: refused on a replicated service.
REPLICA_LOCAL = re.compile(r"^/v1/(images/(load|unload)|training/(start|stop|cancel)|datasets/.+)$")
#: Routes answered as a stream of events.
STREAMS = re.compile(r"/events$")
#: Headers that belong to one hop, not to the request (``Host`` is kept: the replica's
#: guard checks it, as the single server's does).
HOP_HEADERS = frozenset({"content-length", "connection", "transfer-encoding", "keep-alive"})
#: Ongoing requests a replica takes: its own job queue bounds the work (429), and an
#: event stream stays open for a job's whole life, so Ray Serve's cap is set out of the way.
MAX_ONGOING = 1000
#: Seconds a request is retried on other replicas after its replica died under it.
RETRY_S = 30.0



def job_owner(path: str) -> str | None:
    """The replica that owns the job a path is about, from the job id's suffix; None otherwise."""
    found = JOB_PATH.match(path)
    if found is None or "." not in found["id"]:
        return None
    return found["id"].rsplit(".", 1)[1]


class EngineReplica:
    """One Engine and the single-process server's app, on a loopback port of this replica's node."""

    def __init__(self, settings: ServerSettings, load: str | None) -> None:
        import uvicorn

        keep_serve_grpc_local()
        from engine import Engine
        from engine.server.app import create_app

        self.name = serve.get_replica_context().replica_id.unique_id
        outputs = settings.output_roots[0] if settings.output_roots else None
        engine = Engine(runs_dir=outputs, allow_download=settings.allow_hub)
        if load:
            engine.images.load(load)
        app = create_app(engine, dataclasses.replace(settings, replica=self.name, bind_host="127.0.0.1"))
        port = free_loopback_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                   timeout_graceful_shutdown=2))
        threading.Thread(target=self.server.run, daemon=True, name="replica-server").start()
        self.url = f"http://127.0.0.1:{port}"
        self._client: Any = None  # one connection pool, made in Ray Serve's event loop on first use
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    async def handle(self, message: dict[str, Any], owner: str | None = None, avoid: tuple[str, ...] = ()) -> dict[str, Any]:
        """Answer one HTTP request (``method``, ``path``, ``query``, ``headers``, ``body``)."""
        if owner is not None and owner != self.name:
            return {**_lost(message["path"], owner), "replica": self.name}
        response = await self.client().request(message["method"], message["path"], params=message["query"],
                                               headers=message["headers"], content=message["body"])
        return {"status": response.status_code, "headers": kept_headers(response.headers), "body": response.content,
                "replica": self.name}

    async def stream(self, message: dict[str, Any], owner: str | None = None) -> AsyncIterator[Any]:
        """An event route: its status and headers first, then its chunks as they come."""
        if owner is not None and owner != self.name:
            lost = _lost(message["path"], owner)
            yield {"status": 200, "headers": [("content-type", "text/event-stream")]}
            yield f"event: failed\ndata: {lost['body'].decode()}\n\n".encode()  # as a failed job's stream ends
            return
        async with self.client().stream(message["method"], message["path"], params=message["query"],
                                        headers=message["headers"]) as response:
            yield {"status": response.status_code, "headers": kept_headers(response.headers)}
            async for chunk in response.aiter_raw():
                yield chunk

    def client(self) -> Any:
        """The replica's HTTP client to its own app (kept: one connection pool for every request)."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=None)
        return self._client

    def check_health(self) -> None:
        """Ray Serve's health check: the replica's server thread must be serving."""
        if not self.server.started or self.server.should_exit:
            raise RuntimeError("the replica's server stopped")


def _lost(path: str, owner: str) -> dict[str, Any]:
    """A job whose replica is gone: failed with it (a follow-up never hangs)."""
    found = JOB_PATH.match(path)
    job_id = found["id"] if found else "?"
    job = {"id": job_id, "state": "failed", "position": None, "step": 0, "steps": 0, "images": [],
           "error": {"code": "replica_lost", "message": f"the replica {owner} that ran this job stopped serving; "
                     "the job failed with it (submit it again: another replica takes it)"}}
    return {"status": 200, "headers": [("content-type", "application/json")], "body": json.dumps(job).encode()}


def kept_headers(headers: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_HEADERS]


class JobAffinityRouter(RequestRouter):  # type: ignore[misc]
    """Ray Serve's request router, told that a job's requests go to the replica that owns the job."""

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        owner = kwargs.get("owner")
        if owner:
            owned = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
            return [owned or candidate_replicas]  # gone: any replica says the job failed with it
        avoid = set(kwargs.get("avoid") or ())
        fresh = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        return [fresh, [r for r in candidate_replicas if r not in fresh]] if fresh else [candidate_replicas]


def keep_serve_grpc_local() -> None:
    """On a loopback-only Ray, bind this replica's inter-deployment gRPC server to loopback.

    Ray Serve binds that server to ``[::]:0`` (every interface) whatever the node
    address is; each replica calls this from its ``__init__``, which Ray Serve runs
    before it starts that server. Where Ray Serve changes and the name is gone,
    nothing is patched (``tests/faces/test_replicas.py`` reads the listening sockets)."""
    if os.environ.get(RAY_LOCAL_ONLY_ENV) != "0":
        return
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback_only", False):
        return

    def bind_on_loopback(server: Any, address: str) -> Any:
        return bind(server, address.replace("[::]", "127.0.0.1", 1))

    bind_on_loopback.loopback_only = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind_on_loopback
