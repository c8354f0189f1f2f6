"""The front of a replicated service: every HTTP request, handed to a replica.

Ray Serve's HTTP proxy hands each request to :class:`Front`, which passes it to an
``EngineReplica`` through a ``DeploymentHandle`` (see :mod:`engine.server.replicas`
for the design). Kept in a module of its own, without postponed annotations: Ray
Serve turns the class's routes into methods at import, and FastAPI must see the
real ``Request`` class in their signatures, not its name.

The front is the service's door, so it is guarded as the single server is, by the
same :class:`~engine.server.guard.Guard` settings, before it reads a body: a request
without the token is a 401 (not a 409, nor a body read first), a foreign ``Host`` or a
cross-site state change a 403, a body past the cap a 413 as soon as it passes it.
Each replica's app checks the request again.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from engine.server.guard import Guard, Refusal
from engine.server.replicas import REPLICA_LOCAL, RETRY_S, STREAMS, job_owner, keep_serve_grpc_local, kept_headers
from engine.server.responses import error_bytes
from engine.server.settings import ServerSettings

front_app = FastAPI(title="diffusion-engine (replicas)")


@serve.ingress(front_app)  # at import: a replica imports this module, and must see the same routes
class Front:
    """Every HTTP request, handed to a replica (see the module docstring)."""

    def __init__(self, replicas: Any, settings: ServerSettings) -> None:
        from engine.server.app import guard_options

        keep_serve_grpc_local()
        self.replicas = replicas
        self.guard = Guard(front_app, **guard_options(settings))  # its checks only: Ray Serve runs the app

    @front_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def forward(self, path: str, request: Request) -> Response:
        path = request.url.path
        scope = dict(request.scope)  # a copy: the guard takes a ?token= out of it, and the replica checks it too
        refusal = self.guard.refusal(scope)
        if refusal is not None:
            return self._refused(refusal)
        body = await self._capped_body(request, self.guard.limit(scope))
        if body is None:
            return self._refused((413, "body_too_large", "the request body is larger than this server accepts "
                             f"({self.guard.limit(scope)} bytes)", []))
        if REPLICA_LOCAL.match(path) and request.method != "GET":
            return JSONResponse({"error": {"code": "not_with_replicas", "message": (
                f"{request.method} {path} would change one replica of a replicated service; it serves its "
                "--load model (restart `serve --replicas` to change it), and training runs with `train`")}},
                status_code=409)
        message = {"method": request.method, "path": path, "query": str(request.url.query),
                   "headers": kept_headers(request.headers), "body": body}
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

    # Methods, not module functions: Ray Serve ships the class, not this module.

    @staticmethod
    async def _capped_body(request: Request, limit: int) -> "bytes | None":
        """The body, read as it streams in; None as soon as it passes ``limit`` bytes."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _refused(refusal: Refusal) -> Response:
        status, code, message, headers = refusal
        return Response(error_bytes(code, message), status_code=status, media_type="application/json",
                        headers={name.decode("latin-1"): value.decode("latin-1") for name, value in headers})
