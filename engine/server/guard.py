"""The outermost layer of the app: token, body cap and last-resort errors.

A plain ASGI middleware, so it runs before FastAPI reads or parses a byte
of the body (a dependency would run after the body was parsed: a 200 MB
unauthenticated body used to cost half a gigabyte before its 401):

1. the bearer token is checked first (schema, docs and the web page's
   static files excepted: :mod:`engine.server.pages`); on the event-stream
   routes it may come as ``?token=`` instead, because the browser's
   ``EventSource`` cannot send an ``Authorization`` header (the parameter is
   then removed from the request, so access logs do not show it);
2. a declared ``Content-Length`` over the cap is refused with 413 at once,
   and the bytes actually received are counted as they stream in, so a
   chunked body is refused as soon as it passes the cap;
3. an exception nothing else handled is logged here with its traceback and
   answered with a 500 in the one error shape, code ``internal_error``,
   without the traceback.
"""

from __future__ import annotations

import logging
import re
import secrets
from urllib.parse import parse_qsl, urlencode
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
    def __init__(
        self, app: ASGIApp, *, token: str | None, max_body_bytes: int, public_paths: Collection[str],
        public_prefixes: tuple[str, ...] = (), query_token_paths: re.Pattern[str] | None = None,
    ) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.public_paths = frozenset(public_paths)
        #: The web page's static files (they hold no data; every API call they make needs the token).
        self.public_prefixes = public_prefixes
        #: Paths (GET only) that also take the token as ``?token=``: the SSE routes.
        self.query_token_paths = query_token_paths

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
        if self.token is not None and not self._public(str(scope.get("path"))) and not (
            self._authorised(headers) or self._authorised_by_query(scope)
        ):
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

    def _public(self, path: str) -> bool:
        """The schema, the docs and the web page's files; ``..`` never counts as public."""
        if path in self.public_paths:
            return True
        return path.startswith(self.public_prefixes) and ".." not in path.split("/")

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        assert self.token is not None
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(given, self.token)

    def _authorised_by_query(self, scope: Scope) -> bool:
        """A ``?token=`` on an event-stream route; taken out of the query once checked."""
        if self.query_token_paths is None or scope.get("method") != "GET":
            return False
        if not self.query_token_paths.fullmatch(str(scope.get("path", ""))):
            return False
        assert self.token is not None
        pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [value for name, value in pairs if name == "token"]
        if len(given) != 1 or not secrets.compare_digest(given[0].encode("utf-8"), self.token):
            return False
        scope["query_string"] = urlencode([(n, v) for n, v in pairs if n != "token"]).encode("latin-1")
        return True

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
