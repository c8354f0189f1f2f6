"""The one error shape, ``{"error": {"code", "message"}}``, for every status.

Clients switch on ``code``; ``message`` is for people. Every error the server
sends goes through :func:`error_payload`, which bounds what a message may
echo of the request (a 1 MB name is not sent back whole) and makes it valid
UTF-8 (a lone surrogate from a JSON ``\\ud800`` escape would otherwise fail
the encoding of the response itself).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.errors import EngineError
from engine.requests import describe_problems as sentences_of

#: The most characters of any one input (a run without whitespace) a message echoes.
ECHO_LIMIT = 200
#: The most characters of a whole message.
MESSAGE_LIMIT = 1000
#: Validation problems listed in one 422 message; the rest are counted.
PROBLEMS_LISTED = 5


HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "queue_full",
    500: "internal_error",
}

_LONG_RUN = re.compile(r"\S{%d,}" % (ECHO_LIMIT + 1))


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, marked when cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def valid_text(text: str) -> str:
    """``text`` with lone surrogates replaced, so it encodes as UTF-8."""
    return text.encode("utf-8", "replace").decode("utf-8")


def error_payload(code: str, message: str) -> dict[str, dict[str, str]]:
    message = _LONG_RUN.sub(lambda match: clip(match.group()), valid_text(message))
    return {"error": {"code": valid_text(code)[:64], "message": clip(message, MESSAGE_LIMIT)}}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_payload(code, message), status_code=status, headers=headers)


def error_bytes(code: str, message: str) -> bytes:
    """The payload encoded, for the ASGI middleware that answers without FastAPI."""
    return json.dumps(error_payload(code, message)).encode("utf-8")


def status_for(error: EngineError) -> int:
    """The error's own HTTP status, from the error catalogue (``docs/errors.md``)."""
    return error.status


async def engine_error(_: Request, error: EngineError) -> JSONResponse:
    body: dict[str, object] = dict(error_payload(error.code, error.message)["error"])
    if error.also:  # the request's other refusals, each in the one shape
        body["also"] = [error_payload(other.code, other.message)["error"] for other in error.also]
    return JSONResponse({"error": body}, status_code=status_for(error))


async def http_error(_: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method, 413 body) in the one shape. Its 400
    is a body it could not parse (a malformed multipart form): a body error is 422 everywhere."""
    if error.status_code == 400:
        return error_response(422, "invalid_request", f"the request body is malformed ({error.detail})")
    code = HTTP_CODES.get(error.status_code, "http_error")
    message = error.detail if isinstance(error.detail, str) else code.replace("_", " ")
    return error_response(error.status_code, code, message, headers=error.headers)


async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(422, "invalid_request", describe_problems(error.errors()))


def describe_problems(problems: Any) -> str:
    """``field must be ...`` for the first few problems, named by their JSON field (the
    request vocabulary's own wording, as the CLI names flags); inputs are never echoed whole."""
    problems = list(problems)

    def name_of(loc: tuple[int | str, ...]) -> str:
        parts = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
        return ".".join(clip(str(part), 60) for part in parts) or "the request body"

    listed = [clip(sentence) for sentence in sentences_of(problems[:PROBLEMS_LISTED], name_of)]
    more = len(problems) - len(listed)
    return "; ".join(listed) + (f"; and {more} more" if more > 0 else "")