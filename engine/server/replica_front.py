"""The front of a replicated service: every HTTP request, handed to a replica.

Ray Serve's HTTP proxy hands each request to :class:`Front`, which passes it to an
``EngineReplica`` through a ``DeploymentHandle`` (see :mod:`engine.server.replicas`
for the design). Kept in a module of its own, without postponed annotations: Ray
Serve turns the class's routes into methods at import, and FastAPI must see the
real ``Request`` class in their signatures, not its name.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from engine.server.replicas import REPLICA_LOCAL, RETRY_S, STREAMS, job_owner, kept_headers

front_app = FastAPI(title="diffusion-engine (replicas)")


@serve.ingress(front_app)  # at import: a replica imports this module, and must see the same routes
class Front:
    """Every HTTP request, handed to a replica (see the module docstring)."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas

    @front_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def forward(self, path: str, request: Request) -> Response:
        path = request.url.path
        if REPLICA_LOCAL.match(path) and request.method != "GET":
            return JSONResponse({"error": {"code": "not_with_replicas", "message": (
                f"{request.method} {path} would change one replica of a replicated service; it serves its "
                "--load model (restart `serve --replicas` to change it), and training runs with `train`")}},
                status_code=409)
        message = {"method": request.method, "path": path, "query": str(request.url.query),
                   "headers": kept_headers(request.headers), "body": await request.body()}
        owner = job_owner(path)
        if STREAMS.search(path):
            chunks = self.replicas.options(stream=True).stream.remote(message, owner=owner)
            head = await chunks.__anext__()

            async def rest() -> AsyncIterator[bytes]:  # a closure: Ray Serve ships the class, not this module
                async for chunk in chunks:
                    yield chunk

            return StreamingResponse(rest(), status_code=head["status"], headers=dict(head["headers"]))
        tried: list[str] = []
        while True:  # a new job refused for a full queue is offered to every other replica first
            reply = await self._call(message, owner, tuple(tried))
            if reply["status"] != 429 or owner is not None or reply["replica"] in tried:
                return Response(reply["body"], status_code=reply["status"], headers=dict(reply["headers"]))
            tried.append(reply["replica"])

    async def _call(self, message: dict[str, Any], owner: str | None, avoid: tuple[str, ...]) -> dict[str, Any]:
        """One replica's answer; a replica that died under the call is retried on the others
        (Ray Serve drops it from the routing within seconds)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError

        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                return await self.replicas.handle.remote(message, owner=owner, avoid=avoid)
            except (RayActorError, ReplicaUnavailableError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

