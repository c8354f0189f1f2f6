"""Confine request paths to the roots the operator configured.

A path from a request is resolved against its root (relative paths) and
through every symlink (``realpath``); it is accepted only when the result
lies inside one of the roots. ``..`` traversal, absolute paths elsewhere and
symlinks that lead out are all refused, before anything under them is read.

A path the file system cannot even look up (a NUL byte, a lone surrogate, a
part over NAME_MAX bytes, the whole over PATH_MAX) is refused as malformed,
with code ``invalid_path``, before any system call can fail on it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path, PurePath

from engine.errors import EngineError
from engine.places import NAME_MAX, PATH_MAX, real, within
from engine.requests import is_hub_id

#: Characters of a refused path a message repeats.
ECHO = 120


class PathRefused(EngineError):
    code = "path_outside_roots"


class InvalidPath(EngineError):
    code = "invalid_path"


def confine(value: str, roots: Sequence[Path], what: str) -> Path:
    """``value`` resolved inside one of ``roots``, or :class:`PathRefused` / :class:`InvalidPath`."""
    if not roots:
        raise PathRefused(f"no {what} roots are configured on this server; {what} paths are refused")
    check_form(value, what)
    try:
        return _inside(value, roots, what)
    except (OSError, RuntimeError, KeyError) as exc:  # ELOOP, EACCES; expanduser of an unknown ~user
        raise InvalidPath(f"{what} path {_echo(value)} cannot be resolved ({getattr(exc, 'strerror', None) or exc}); "
                          "give a path inside the configured roots") from None


def confine_model(value: str, roots: Sequence[Path], *, allow_hub: bool,
                  checkpoint_names: Collection[str] = ()) -> str:
    """A model path confined like any other, or, with ``allow_hub``, a hub repo id
    (or a checkpoint name, which stands for its hub repo: ``checkpoint_names``, lower
    case) passed through when it is written as one and nothing by that name lies in a
    root (a name that does exist there, a symlink leading out included, is a path)."""
    check_form(value, "model")
    # The server's working folder counts too: the engine would find ``org/name`` there first.
    local = any(os.path.lexists(p) for p in (value, *(Path(r) / value for r in roots)))
    named = value.strip().lower() in checkpoint_names
    if allow_hub and (is_hub_id(value) or named) and not local:
        return value
    if named and not local:
        raise PathRefused(f"{_echo(value)} is a checkpoint name: it stands for a hub model, and hub models are "
                          "not accepted by this server (it was started without --allow-hub); give a model "
                          "folder inside the model roots", code="hub_not_allowed")
    return str(confine(value, roots, "model"))


def check_form(value: str, what: str) -> None:
    """Refuse a path no file system call could take, naming the limit it breaks."""
    if "\x00" in value:
        raise InvalidPath(f"{what} path contains a NUL byte")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPath(f"{what} path is not valid Unicode (a lone surrogate)") from None
    if len(encoded) > PATH_MAX:
        raise InvalidPath(f"{what} path is {len(encoded)} bytes long; the limit is {PATH_MAX}")
    for part in PurePath(value).parts:
        if len(part.encode("utf-8")) > NAME_MAX:
            raise InvalidPath(f"{what} path part {_echo(part)} is longer than {NAME_MAX} bytes, "
                              "the most a file or folder name may have")


def _inside(value: str, roots: Sequence[Path], what: str) -> Path:
    real_roots = [real(root) for root in roots]
    candidate = Path(value).expanduser()
    bases = [candidate] if candidate.is_absolute() else [root / candidate for root in real_roots]
    inside = [resolved for resolved in (real(base) for base in bases)
              if any(within(root, resolved) for root in real_roots)]
    if inside:  # with several roots, the one where the path exists wins
        return next((p for p in inside if p.exists()), inside[0])
    raise PathRefused(
        f"{what} path {_echo(value)} is outside the configured {what} roots "
        f"({', '.join(str(r) for r in real_roots)})"
    )


def _echo(value: str) -> str:
    return repr(value if len(value) <= ECHO else f"{value[:ECHO]}...")
