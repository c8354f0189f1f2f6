"""Hub repo ids told from local paths, and the offline hub refused up front.

A string written as a path (``./x``, ``/data/x``, ``a/b/c``) that does not
exist is a missing path, never a hub id; a hub model (or the hub base of a
single-file or GGUF model) is refused before anything is evicted when the hub
is offline and the repo is not in the local cache. Reads the cache only; never
reaches the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.errors import PreflightError
from engine.preflight.source import ModelSource

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUTHY = {"1", "ON", "YES", "TRUE"}


def looks_like_path(text: str) -> bool:
    """Whether ``text`` is written as a filesystem path, not a hub repo id.

    A repo id is exactly ``org/name``. Anything anchored (``/``, ``./``,
    ``../``, ``~``), with a backslash, with no slash or more than one, or with a
    ``.``/``..`` component is a path; a path that does not exist is missing,
    and is never sent to a hub.
    """
    if text.startswith(("/", "~")) or "\\" in text or os.sep in text.replace("/", ""):
        return True
    parts = text.split("/")
    return len(parts) != 2 or any(part in ("", ".", "..") for part in parts)


def is_hub_id(text: str) -> bool:
    """``text`` is written as a hub repo id (``org/name``), not as a path.

    Syntax only: the caller checks first that no such local path exists.
    """
    return not looks_like_path(text) and ".." not in text and bool(_HUB_ID.match(text))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now, not at import time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUTHY


def hub_access_error(source: ModelSource) -> PreflightError | None:
    """Why the hub repo ``source`` needs cannot be had now, or None.

    A hub model, or the hub base of a single-file / GGUF model, is refused
    before anything is evicted when the hub is offline and the repo is not in
    the local cache, instead of failing inside the loader after the GPU was
    freed. Reads the cache only; never reaches the network.
    """
    if source.kind == "hub":
        repo: str | None = source.location
    elif source.base and not Path(source.base).expanduser().is_dir():
        repo = source.base
    else:
        repo = None
    if repo is None or not hub_offline() or _in_hub_cache(repo):
        return None
    return PreflightError(
        f"{repo} is a hub repo id, the hub is offline here (HF_HUB_OFFLINE is set) and the "
        f"repo is not in the local cache; download it (huggingface-cli download {repo}) and "
        "pass the local folder, or allow hub access",
        code="hub_offline",
    )


def _in_hub_cache(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, "model_index.json"), str)
