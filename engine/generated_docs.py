"""The pages of docs/ that are generated, written the one way.

``docs/errors.md`` (the error catalogue), ``docs/controls.md`` (the request
table) and ``docs/cli.md`` (every command's ``--help``) are rendered from the
code that defines them; each module's ``python -m`` entry point writes its
page through :func:`write_page`, and a test compares the page with a fresh
render, so a change without its page fails the suite.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def write_page(name: str, render: Callable[[], str], argv: list[str] | None = None) -> int:
    """Write ``render()`` to ``docs/<name>`` (or the path in ``argv``); the CLI entry of each page."""
    target = Path(argv[0]) if argv else DOCS / name
    target.write_text(render(), encoding="utf-8")
    print(f"wrote {target}")
    return 0
