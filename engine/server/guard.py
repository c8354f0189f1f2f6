"""The outermost layer of the app: token, body cap and last-resort errors.

A plain ASGI middleware, so it runs before FastAPI reads or parses a byte
of the body (a dependency would run after the body was parsed: a 200 MB
unauthenticated body used to cost half a gigabyte before its 401):

0. the request must name this server: a loopback server answers only a
   ``Host`` of a loopback name (or one the operator allowed), so a web page
   that re-points its own name at 127.0.0.1 (DNS rebinding) is refused;
   a state-changing request (not GET/HEAD/OPTIONS) that a browser sent from
   another site (its ``Origin`` or ``Sec-Fetch-Site`` says so) is refused;
   and without a token a POST must be JSON (or multipart on the routes that
   take uploads), which a cross-site page cannot send without a CORS
   preflight that this server never grants. Two ``Authorization`` headers
   are refused rather than one of them picked;
1. the bearer token is checked (schema, docs and the web page's
   static files excepted: :mod:`engine.server.pages`); on the event-stream
   routes it may come as ``?token=`` instead, because the browser's
   ``EventSource`` cannot send an ``Authorization`` header (a ``token``
   parameter is removed from every request's query before anything logs it,
   accepted or not);
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
from urllib.parse import parse_qsl, urlencode, urlsplit
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
#: (status, code, message, extra headers) of a refusal answered here.
Refusal = tuple[int, str, str, list[tuple[bytes, bytes]]]
#: Methods that change nothing: browsers send them cross-site freely, and so they are not guarded by Origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hostname(host: bytes) -> str:
    """``127.0.0.1:8000`` -> ``127.0.0.1``; ``[::1]:8000`` -> ``::1``; lower case."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        # ``[::1]`` or ``[::1]:PORT`` only: ``[::1]evil:PORT`` names no host of ours, so it is kept whole
        # (and matches no allowed name).
        match = re.fullmatch(r"\[([0-9a-f:.]+)\](?::\d{1,5})?", text)
        return match.group(1) if match else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once the streamed body passes the cap; FastAPI
    lets an ``HTTPException`` from body reading through, so it becomes a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)")


class Guard:
    def __init__(
        self, app: ASGIApp, *, token: str | None, max_body_bytes: int, public_paths: Collection[str],
        public_prefixes: tuple[str, ...] = (), query_token_paths: re.Pattern[str] | None = None,
        allowed_hosts: Collection[str] | None = None, form_paths: re.Pattern[str] | None = None,
        upload_paths: re.Pattern[str] | None = None, max_upload_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.public_paths = frozenset(public_paths)
        #: The web page's static files (they hold no data; every API call they make needs the token).
        self.public_prefixes = public_prefixes
        #: Paths (GET only) that also take the token as ``?token=``: the SSE routes.
        self.query_token_paths = query_token_paths
        #: Host names requests may give (None: any; see ``engine.server.settings.allowed_hosts``).
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts) if allowed_hosts is not None else None
        #: Paths whose POST takes a multipart upload.
        self.form_paths = form_paths
        #: Paths whose POST is a file upload, capped at ``max_upload_bytes`` instead (dataset images).
        self.upload_paths = upload_paths
        self.max_upload_bytes = max_upload_bytes or max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        await self._serve(scope, receive, send)

    def refusal(self, scope: Scope) -> Refusal | None:
        """Why this request is refused before a byte of its body is read (steps 0 to 2), or None.
        A ``token`` in the query is taken out of ``scope`` here. Also how a replicated service's
        front (:mod:`engine.server.replica_front`) guards itself before it reads a body."""
        raw = list(scope.get("headers", ()))
        headers = {name.lower(): value for name, value in raw}
        query_token = self._take_query_token(scope)
        return (self._duplicate(raw) or self._foreign(scope, headers) or self._unauthorised(scope, headers, query_token)
                or self._too_large(headers, self.limit(scope)))

    @staticmethod
    def _take_query_token(scope: Scope) -> list[str] | None:
        """Every ``token`` in the query, taken out of it (so no log line shows one); None: there was none."""
        query = scope.get("query_string", b"")
        if b"token" not in query:
            return None
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        given = [value for name, value in pairs if name == "token"]
        if not given:
            return None
        scope["query_string"] = urlencode([(n, v) for n, v in pairs if n != "token"]).encode("latin-1")
        return given

    @staticmethod
    def _duplicate(raw: list[tuple[bytes, bytes]]) -> Refusal | None:
        for header in (b"authorization", b"host", b"origin", b"content-type"):
            if sum(1 for name, _ in raw if name.lower() == header) > 1:
                name = header.decode()
                return 400, "bad_request", f"the request has more than one {name.title()} header; send one", []
        return None

    def _foreign(self, scope: Scope, headers: dict[bytes, bytes]) -> Refusal | None:
        """A request that names another host, or a browser's state change from another site."""
        host = headers.get(b"host")
        if host is not None and any(byte < 0x21 or byte == 0x7F for byte in host):
            return (400, "bad_request", "the Host header holds a space or a control character (a tab, say); "
                    "send the bare host name and port", [])
        if host is not None and self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
            return (403, "host_not_allowed", f"this server answers requests for {', '.join(sorted(self.allowed_hosts))}, "
                    f"not Host {host.decode('latin-1')[:100]!r}; behind a reverse proxy, start it with "
                    "serve --allow-host NAME", [])
        if scope.get("method") in SAFE_METHODS:
            return None
        origin = headers.get(b"origin")
        if origin is not None and not self._same_site(origin, host):
            return (403, "cross_origin_refused", f"a browser page from {origin.decode('latin-1')[:100]!r} may not "
                    "change this server's state; use the server's own page, or a client that is not a browser", [])
        if headers.get(b"sec-fetch-site", b"").lower() == b"cross-site":
            return (403, "cross_origin_refused", "a browser page from another site may not change this server's "
                    "state; use the server's own page, or a client that is not a browser", [])
        if self.token is None and scope.get("method") == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            form = self.form_paths is not None and self.form_paths.fullmatch(str(scope.get("path", "")))
            if not (kind == b"application/json" or kind.endswith(b"+json") or (form and kind == b"multipart/form-data")):
                return (415, "unsupported_media_type", "a POST to a server without a token must be JSON (send "
                        "'Content-Type: application/json'" + (", or a multipart/form-data upload" if form else "")
                        + f"; got {kind.decode('latin-1')[:60] or 'none'!r}): a page on another site cannot send that", [])
        return None

    def _same_site(self, origin: bytes, host: bytes | None) -> bool:
        try:
            parts = urlsplit(origin.decode("latin-1"))
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (a sandboxed frame, a file://) included
        if self.allowed_hosts is not None:
            return parts.hostname.lower() in self.allowed_hosts
        return host is not None and parts.netloc.lower() == host.decode("latin-1").lower()

    def _unauthorised(self, scope: Scope, headers: dict[bytes, bytes], query_token: list[str] | None) -> Refusal | None:
        if self.token is None or self._public(str(scope.get("path"))):
            return None
        if self._authorised(headers) or self._authorised_by_query(scope, query_token):
            return None
        return (401, "unauthorized", "missing or wrong bearer token; send the header "
                "'Authorization: Bearer <token>' with the token the server was started with",
                [(b"www-authenticate", b"Bearer")])

    def limit(self, scope: Scope) -> int:
        """The body cap of this request: the upload cap on an upload route's POST."""
        upload = (self.upload_paths is not None and scope.get("method") == "POST"
                  and self.upload_paths.fullmatch(str(scope.get("path", ""))))
        return self.max_upload_bytes if upload else self.max_body_bytes

    def _too_large(self, headers: dict[bytes, bytes], limit: int) -> Refusal | None:
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return 400, "bad_request", "the Content-Length header is not a number", []
            if int(declared) > limit:
                return (413, "body_too_large", f"the request body ({int(declared)} bytes) is larger than "
                        f"this server accepts ({limit} bytes)", [])
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

    def _authorised_by_query(self, scope: Scope, given: list[str] | None) -> bool:
        """A ``?token=`` on an event-stream route (already taken out of the query)."""
        if given is None or self.query_token_paths is None or scope.get("method") != "GET":
            return False
        if not self.query_token_paths.fullmatch(str(scope.get("path", ""))):
            return False
        assert self.token is not None
        return len(given) == 1 and secrets.compare_digest(given[0].encode("utf-8"), self.token)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False
        limit = self.limit(scope)

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
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
