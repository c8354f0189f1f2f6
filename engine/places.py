"""Where the engine's things are: its per-user data folder, and the one confinement test.

A run is known by the runs root it was found in, a dataset by its dataset root,
a model's companion by the model's folder, a request's path by the server's
roots: each asks "does this path, once every symlink is followed, stay under
that root?". It is answered here, once, so a check cannot drift between them
(``..``, absolute paths and symlinks that lead out all fail the same way).
The runs, datasets and compile cache share one data folder (:func:`data_home`).
Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
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


#: A per-user folder by platform: (override variable, Windows (variable, fallback under home),
#: macOS path under home, elsewhere (XDG variable, fallback under home)).
_DATA = ("DIFFUSION_ENGINE_HOME", ("LOCALAPPDATA", "AppData/Local"), "Library/Application Support",
         ("XDG_DATA_HOME", ".local/share"))
_CONFIG = ("DIFFUSION_ENGINE_KEYS", ("APPDATA", "AppData/Roaming"), "Library/Preferences",
           ("XDG_CONFIG_HOME", ".config"))


def _per_user(where: tuple[str, tuple[str, str], str, tuple[str, str]], *below: str) -> Path:
    """The override variable's folder when set, else ``diffusion-engine/*below`` in the platform's folder."""
    override, windows, macos, xdg = where
    if os.environ.get(override):
        return Path(os.environ[override]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get(windows[0]) or Path.home() / windows[1])
    elif sys.platform == "darwin":
        base = Path.home() / macos
    else:
        base = Path(os.environ.get(xdg[0]) or Path.home() / xdg[1])
    return base.joinpath("diffusion-engine", *below)


def data_home() -> Path:
    """The engine's per-user data folder (runs, datasets, the compile cache), wherever a
    command is run from: ``$DIFFUSION_ENGINE_HOME`` when set; else ``diffusion-engine`` in
    the platform's data folder: ``%LOCALAPPDATA%`` on Windows, ``~/Library/Application
    Support`` on macOS, ``$XDG_DATA_HOME`` (``~/.local/share``) elsewhere."""
    return _per_user(_DATA)


def keys_home() -> Path:
    """Where the engine keeps this user's secrets (the compile cache's signing key), apart
    from :func:`data_home` so that a data folder copied from elsewhere never brings the key
    that would vouch for it: ``$DIFFUSION_ENGINE_KEYS`` when set; else ``diffusion-engine/keys``
    in the platform's config folder: ``%APPDATA%`` on Windows, ``~/Library/Preferences`` on
    macOS, ``$XDG_CONFIG_HOME`` (``~/.config``) elsewhere."""
    return _per_user(_CONFIG, "keys")


#: Variables that hold a secret of this process's (the server's bearer token): never handed to a
#: child process (trainers, the fork server, the stable-diffusion.cpp worker).
SECRET_ENV: tuple[str, ...] = ("DIFFUSION_ENGINE_TOKEN",)


def child_environment(environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``environ`` (this process's by default) less :data:`SECRET_ENV`, with ``extra`` set: what
    a child process the engine starts is given."""
    source = os.environ if environ is None else environ
    return {**{k: v for k, v in source.items() if k not in SECRET_ENV}, **extra}


def default_runs_dir() -> Path:
    """The one runs folder every face uses by default: ``runs`` in :func:`data_home`
    (``train``, ``runs`` and ``serve`` all read and write here)."""
    return data_home() / "runs"


def default_datasets_dir() -> Path:
    """Where datasets live by default: ``datasets`` in :func:`data_home`, beside the runs."""
    return data_home() / "datasets"
