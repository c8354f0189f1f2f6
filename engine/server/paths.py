"""Confine request paths to the roots the operator configured.

A path from a request is resolved against its root (relative paths) and
through every symlink (``realpath``); it is accepted only when the result
lies inside one of the roots. ``..`` traversal, absolute paths elsewhere and
symlinks that lead out are all refused, before anything under them is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from engine.errors import EngineError


class PathRefused(EngineError):
    code = "path_outside_roots"


def confine(value: str, roots: Sequence[Path], what: str) -> Path:
    """``value`` resolved inside one of ``roots``, or :class:`PathRefused`."""
    if not roots:
        raise PathRefused(f"no {what} roots are configured on this server; {what} paths are refused")
    if "\x00" in value:
        raise PathRefused(f"{what} path contains a NUL byte")
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    candidate = Path(value).expanduser()
    bases = [candidate] if candidate.is_absolute() else [root / candidate for root in real_roots]
    inside = [
        resolved
        for resolved in (Path(os.path.realpath(base)) for base in bases)
        if any(resolved == root or root in resolved.parents for root in real_roots)
    ]
    if inside:  # with several roots, the one where the path exists wins
        return next((p for p in inside if p.exists()), inside[0])
    raise PathRefused(
        f"{what} path {value!r} is outside the configured {what} roots "
        f"({', '.join(str(r) for r in real_roots)})"
    )
