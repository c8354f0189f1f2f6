"""Every error code the engine can give is in the catalogue, once, with its HTTP status.

The codes are found the way a reader would: every ``code="..."`` (and class
``code = "..."``) in the engine, the built-in families and the example plugin,
the run records' failure codes, the ``unknown_<kind>`` codes of
:class:`~engine.errors.UnknownName` and the server's own; ``docs/errors.md``
is the catalogue rendered, and the server answers with the catalogue's status.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.error_catalogue import CATALOGUE, _ROWS, render
from engine.errors import Busy, EngineError, PreflightError, UnknownName

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("engine", "families", "examples") for p in (ROOT / folder).rglob("*.py")
           if p.name != "error_catalogue.py"]
PATTERNS = (
    re.compile(r"\bcode(?::\s*str)?\s*=\s*\"([a-z0-9_]+)\""),      # code="x", class code = "x"
    re.compile(r"\"code\":\s*\"([a-z0-9_]+)\""),                  # {"code": "x"}
    re.compile(r"\"code\":[^\n]*\belse\s+\"([a-z0-9_]+)\""),        # {"code": a if b else "x"}
    re.compile(r"(?:\(|return )\s*\d{3},\s*\"([a-z0-9_]+)\""),        # the guard's (403, "x", ...)
    re.compile(r"HTTP_CODES\.get\([^)]*\"([a-z0-9_]+)\"\)"),          # the server's fallback
    re.compile(r"\.(?:fail|abort)\(\s*\"([a-z0-9_]+)\""),         # a run record's failure
    re.compile(r"error_(?:bytes|response)\([^\"\n]*\"([a-z0-9_]+)\""),  # the server's own answers
)


def codes_in_source() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for pattern in PATTERNS:
            for match in pattern.finditer(text):
                found.setdefault(match.group(1), str(path.relative_to(ROOT)))
        for kind in re.findall(r"UnknownName\(\s*\"([a-z ]+)\"", text):
            found.setdefault(f"unknown_{kind.replace(' ', '_')}", str(path.relative_to(ROOT)))
    return found


def test_every_code_raised_anywhere_is_catalogued() -> None:
    from engine.training.records import write_error_code

    found = codes_in_source()
    assert len(found) > 90  # the scan sees the engine's codes at all
    found.update({write_error_code(OSError(28, "")): "records", write_error_code(OSError(13, "")): "records"})
    missing = {code: where for code, where in found.items() if code not in CATALOGUE}
    assert missing == {}


def test_each_code_is_listed_once_and_used() -> None:
    assert len(_ROWS) == len(CATALOGUE)
    from engine.server.responses import HTTP_CODES

    used = set(codes_in_source()) | set(HTTP_CODES.values()) | {"disk_full", "write_failed"}
    text = "".join(p.read_text(encoding="utf-8") for p in SOURCES)
    used |= {code for code in CATALOGUE if f'"{code}"' in text}  # chosen by a lookup, say
    assert sorted(set(CATALOGUE) - used) == []


def test_the_docs_list_every_code_with_its_status() -> None:
    assert (ROOT / "docs" / "errors.md").read_text(encoding="utf-8") == render()
    for row in _ROWS:
        assert f"| `{row.code}` | {row.status} |" in render()


@pytest.mark.parametrize(("error", "status"), [
    (Busy("x"), 409),
    (Busy("x", code="run_in_progress"), 409),
    (UnknownName("family", "nope", ["a"]), 404),
    (PreflightError("x", code="dataset_not_found"), 404),
    (EngineError("x", code="queue_full"), 429),
    (EngineError("x", code="invalid_config"), 422),
    (EngineError("x", code="a_plugins_own_code"), 400),
])
def test_an_error_carries_its_http_status(error: EngineError, status: int) -> None:
    assert error.status == status


def test_the_server_answers_with_the_catalogues_status() -> None:
    from engine.server.responses import status_for

    for row in _ROWS:
        assert status_for(EngineError("x", code=row.code)) == row.status, row.code
