"""Whether a path lies under a root, symlinks resolved: the one confinement test.

A run is known by the runs root it was found in, a dataset by its dataset root,
a model's companion by the model's folder, a request's path by the server's
roots: each asks "does this path, once every symlink is followed, stay under
that root?". It is answered here, once, so a check cannot drift between them
(``..``, absolute paths and symlinks that lead out all fail the same way).
Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The longest file name (one path component, in bytes) most file systems take: a longer
#: name is refused as malformed wherever it comes in, never left to fail as a 500.
NAME_MAX = 255
#: The longest whole path (bytes) Linux takes.
PATH_MAX = 4096


def real(path: str | os.PathLike[str]) -> Path:
    """``path`` with every symlink followed and ``..`` removed (it need not exist)."""
    return Path(os.path.realpath(path))


def within(root: str | os.PathLike[str], path: str | os.PathLike[str], *, strictly: bool = False) -> bool:
    """Whether ``path`` resolves to ``root`` or below it (``strictly``: below only), ``root``
    resolved too."""
    top, where = real(root), real(path)
    return top in where.parents or (not strictly and where == top)
