"""The outermost layer of the app: token, body cap and last-resort errors.

A plain ASGI middleware, so it runs before FastAPI reads or parses a byte
of the body (a dependency would run after the body was parsed: a 200 MB
unauthenticated body used to cost half a gigabyte before its 401):

1. the bearer token is checked first (schema and docs excepted);
2. a declared ``Content-Length`` over the cap is refused with 413 at once,
   and the bytes actually received are counted as they stream in, so a
   chunked body is refused as soon as it passes the cap;
3. an exception nothing else handled is logged here with its traceback and
   answered with a 500 in the one error shape, code ``internal_error``,
   without the traceback.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from engine.server.responses import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("engine.server")


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once the streamed body passes the cap; FastAPI
    lets an ``HTTPException`` from body reading through, so it becomes a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)")


class Guard:
    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int, public_paths: Collection[str]) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        await self._serve(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        """Why the request is refused before its body is read, or None."""
        if self.token is not None and scope.get("path") not in self.public_paths and not self._authorised(headers):
            return (401, "unauthorized", "missing or wrong bearer token; send the header "
                    "'Authorization: Bearer <token>' with the token the server was started with",
                    [(b"www-authenticate", b"Bearer")])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return 400, "bad_request", "the Content-Length header is not a number", []
            if int(declared) > self.max_body_bytes:
                return (413, "body_too_large", f"the request body ({int(declared)} bytes) is larger than "
                        f"this server accepts ({self.max_body_bytes} bytes)", [])
        return None

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        assert self.token is not None
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(given, self.token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await _answer(send, 413, "body_too_large", str(exc.detail), [])
        except Exception:  # the last resort: every unexpected failure, logged with its traceback
            log.exception("unhandled error serving %s %s", scope.get("method"), str(scope.get("path"))[:200])
            if started:
                raise
            await _answer(send, 500, "internal_error", "the server failed to answer this request; "
                          "the error is logged on the server", [])


async def _answer(send: Send, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = error_bytes(code, message)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})
