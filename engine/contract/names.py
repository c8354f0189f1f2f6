"""What a model's name says: its own name (never its folders'), and the markers it carries.

Rules keyed on names (a pre-quantised repo's ``-bnb-4bit``) read these two; their own
module so the contract's types stay a table of records. Re-exported by
:mod:`engine.contract.types`.
"""

from __future__ import annotations

import fnmatch
import re


def model_name(model_id: str) -> str:
    """A model's own name: the last component of a repo id or a local path.

    Rules keyed on names (pre-quantised patterns) read this and never the
    folders above it: ``/data/checkpoint4/model-dev`` is called ``model-dev``,
    and its parent's ``int4`` says nothing about the model.
    """
    parts = [part for part in model_id.replace("\\", "/").split("/") if part]
    return parts[-1] if parts else model_id


#: What separates the tokens of a model name (``Model.1-dev_bnb-4bit``: model, 1, dev, bnb, 4bit).
_TOKEN_SEPARATORS = re.compile(r"[^a-z0-9]+")


def name_has_marker(name: str, pattern: str) -> bool:
    """Whether a model name carries ``pattern``, case-insensitively.

    A pattern ``*marker*`` whose marker is tokens (``*int4*``, ``*bnb-4bit*``, ``*-4bit*``)
    matches them as whole tokens of the name, in order: ``model-int4`` and
    ``Model.1-dev-bnb-4bit`` carry theirs; ``checkpoint4``, ``mint4-model`` and
    ``paint4k`` carry none, where a substring glob took all three for 4-bit repos.
    Any other glob (``model-*-q?``) matches as a glob over the whole name.
    """
    lowered, wanted = name.lower(), pattern.lower()
    inner = wanted[1:-1] if len(wanted) > 2 and wanted.startswith("*") and wanted.endswith("*") else None
    if inner is None or any(c in inner for c in "*?[]"):
        return fnmatch.fnmatch(lowered, wanted)
    marker = [t for t in _TOKEN_SEPARATORS.split(inner) if t]
    tokens = [t for t in _TOKEN_SEPARATORS.split(lowered) if t]
    return bool(marker) and any(tokens[i:i + len(marker)] == marker for i in range(len(tokens)))
