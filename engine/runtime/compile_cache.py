"""torch's compile cache ("mega-cache") kept on disk per machine and model.

A regional compile costs 25-58 s on the first image after every load (the
earlier system's measurement): inductor generates and builds its kernels
again in each new process. torch can hand back every artifact a process
compiled (``torch.compiler.save_cache_artifacts``) and take them in another
process before it compiles (``load_cache_artifacts``): the compile then hits
its caches instead of building.

The artifacts are keyed by what makes them valid: the environment (torch,
its CUDA, the device, diffusers), the model (its folder or hub id and its
denoiser config) and how it is compiled (dtype, quantisation, regions,
fullgraph, backend). The image shapes live inside the artifacts (a dynamic
compile's graphs cover the shapes it met); the key's manifest lists the
shapes already saved, so a new shape saves the grown set once and a shape
seen before writes nothing. ``DIFFUSION_ENGINE_COMPILE_CACHE=0`` turns it off.
A cache that cannot be read is dropped and rebuilt; nothing here can fail a
generate.

torch unpickles these artifacts while it fills its caches, so a file planted
in the cache folder (a shared or copied data folder) would run code. Nothing
from disk reaches torch unchecked:

* every ``.bin`` is authenticated: its HMAC-SHA256, under a random per-user key,
  is in the key's manifest, and the file is handed to torch only when it matches
  (a planted or edited file is dropped and the model compiles afresh);
* the key lives apart from the folder it signs (``compile-cache.key`` in
  :func:`engine.places.keys_home`, mode 0600; never inside the cache folder), and
  the signature covers the cache folder's own identity (its device and inode, and
  the user): a folder copied from another machine or user, or restored from a
  backup, its old key beside it or not, is rebuilt, never restored;
* the folder and the key must be this user's and writable by no one else
  (else the cache is off for the process, with the reason in the status);
* every artifact name is checked before torch joins it into a path (a
  relative path of plain names, no ``..``, no absolute path); one bad name
  drops the whole file, so a cache is never half-restored.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import platform
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field

from engine import stored
from engine.places import data_home, keys_home, within

KILL_SWITCH = "DIFFUSION_ENGINE_COMPILE_CACHE"
#: The per-user key that signs every artifact file this user's processes write.
KEY_NAME = "compile-cache.key"
#: One component of an artifact's name: torch joins these under its cache folders.
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
#: The most artifacts (and bytes) one file may hold before it is refused unread.
MAX_ARTIFACTS = 100_000
MAX_BYTES = 4 * 2**30


class Untrusted(Exception):
    """A cache folder, key or file that this process must not hand to torch."""


def private_folder(folder: Path) -> Path:
    """``folder``, created 0700 when missing; refused when it is a symlink, another
    user's, or writable by its group or others (anyone else could plant a file)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{folder} is not a plain folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise Untrusted(f"{folder} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{folder} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); chmod go-w it")
    return folder


def key_path() -> Path:
    """The signing key's file: ``compile-cache.key`` in :func:`engine.places.keys_home`."""
    return keys_home() / KEY_NAME


def user_key(signs: Path) -> bytes:
    """The per-user signing key (made once, 0600) for the cache folder ``signs``; refused if
    anyone else could read or write it, or if it lies inside the folder it signs (a copied
    folder would bring its own key)."""
    path = key_path()
    if within(signs, path):
        raise Untrusted(f"the signing key {path} lies inside the cache folder it signs; "
                        "set DIFFUSION_ENGINE_KEYS to a folder outside it")
    path = private_folder(path.parent) / KEY_NAME
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(handle, "wb") as out:
            out.write(secrets.token_bytes(32))
    handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(handle, "rb") as source:
        info = os.fstat(source.fileno())
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise Untrusted(f"{path} belongs to another user")
        if info.st_mode & 0o077:
            raise Untrusted(f"{path} is readable or writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        key = source.read(64)
    if len(key) < 32:
        raise Untrusted(f"{path} is not a key this engine wrote")
    return key


def signature(key: bytes, name: str, data: bytes, place: str) -> str:
    """HMAC-SHA256 of an artifact file under the user's key, bound to its cache key's name and
    the folder it was written in (:func:`folder_identity`)."""
    return hmac.new(key, f"{place}\0{name}\0".encode() + data, hashlib.sha256).hexdigest()


def folder_identity(folder: Path) -> str:
    """The cache folder as this file system knows it (device, inode) and whose it is: a copy of
    the folder, anywhere, is another folder, so nothing signed in the original verifies there."""
    info = os.lstat(folder)
    return f"{info.st_dev}:{info.st_ino}:{getattr(os, 'getuid', lambda: 0)()}"


def safe_artifact_name(name: object) -> bool:
    """A name torch may join under its cache folder: a relative path of plain parts."""
    if not isinstance(name, str) or not name or len(name) > 1024 or name.startswith(("/", "\\")):
        return False
    return all(_NAME_PART.fullmatch(part) for part in name.split("/"))


def checked_artifacts(data: bytes) -> Any:
    """The artifacts in ``data``, read without filling any cache, every name checked.

    torch's reader builds plain (type, name, bytes) records here; nothing is
    unpickled until ``populate_caches``, which runs only on what this returns.
    """
    from torch.compiler._cache import CacheArtifactManager

    artifacts = CacheArtifactManager.deserialize(data)
    if not artifacts:
        raise Untrusted("the file holds no artifacts this torch can read")
    count = 0
    for kind, items in artifacts.items():
        for artifact in items:
            count += 1
            if count > MAX_ARTIFACTS or not safe_artifact_name(getattr(artifact, "key", None)):
                raise Untrusted(f"a {kind} artifact's name is not a plain relative name: "
                                f"{str(getattr(artifact, 'key', ''))[:80]!r}")
    return artifacts


def cache_folder() -> Path:
    """``compile-cache`` in the engine's data folder, beside the runs (:func:`engine.places.data_home`)."""
    return data_home() / "compile-cache"


def environment() -> dict[str, object]:
    """What compiled artifacts depend on beyond the model: torch, its CUDA, the device, diffusers."""
    import diffusers

    device: object = platform.machine() or "cpu"
    if torch.cuda.is_available():
        device = [torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())]
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
            "diffusers": diffusers.__version__, "python": platform.python_version()}


def model_identity(location: str) -> dict[str, object]:
    """A model folder by its real path and its denoiser configs' contents; a hub id as itself."""
    path = Path(location).expanduser()
    if not path.exists():
        return {"hub": location}
    configs = sorted(path.glob("*/config.json")) + sorted(path.glob("model_index.json"))
    digest = hashlib.sha256()
    for config in configs:
        with contextlib.suppress(OSError):
            digest.update(config.read_bytes())
    return {"path": os.path.realpath(path), "configs": digest.hexdigest()}


@dataclass(frozen=True)
class Manifest:
    """A cache key's manifest as read back: the shapes its artifacts cover and their signature."""

    shapes: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=10_000)]
    hmac: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


@dataclass
class CompileCache:
    """One key's artifacts (``<key>.bin``) and the shapes they cover (``<key>.json``)."""

    folder: Path
    key: str
    shapes: set[str] = field(default_factory=set)
    #: What the last restore or store did, for the session's status.
    last: dict[str, object] = field(default_factory=dict)

    @classmethod
    def for_model(cls, location: str, compiled: dict[str, object], folder: Path | None = None) -> CompileCache | None:
        """The cache of ``location`` compiled as ``compiled`` says; None when turned off."""
        if os.environ.get(KILL_SWITCH, "1").strip() == "0":
            return None
        parts = {"environment": environment(), "model": model_identity(location), "compiled": compiled}
        key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
        cache = cls(folder or cache_folder(), key)
        with contextlib.suppress(stored.UnreadableRecord):
            cache.shapes = set(cache._read_manifest().shapes)
        return cache

    def sign(self, data: bytes) -> str:
        """The signature ``data`` must carry in this cache's manifest (raises :class:`Untrusted`
        or ``OSError`` where the folder or the key cannot be trusted)."""
        return signature(user_key(self.folder), self.key, data, folder_identity(private_folder(self.folder)))

    def _read_manifest(self) -> Manifest:
        return stored.read_record(self._manifest, Manifest, root=self.folder)

    @property
    def _artifacts(self) -> Path:
        return self.folder / f"{self.key}.bin"

    @property
    def _manifest(self) -> Path:
        return self.folder / f"{self.key}.json"

    def restore(self) -> dict[str, object]:
        """Hand torch the saved artifacts before compiling, once they are authenticated
        and every name is checked; what was loaded (or why nothing)."""
        if not self._artifacts.is_file():
            self.last = {"restored": False, "reason": "no saved artifacts for this model and machine yet"}
            return self.last
        try:
            manifest = self._read_manifest()
            if self._artifacts.is_symlink() or self._artifacts.stat().st_size > MAX_BYTES:
                raise Untrusted("the artifacts file is a link, or larger than any this engine writes")
            data = self._artifacts.read_bytes()
            if not hmac.compare_digest(manifest.hmac, self.sign(data)):
                raise Untrusted("the artifacts file is not signed with this user's key in this folder "
                                "(planted, copied from elsewhere or edited)")
            artifacts = checked_artifacts(data)
        except (Untrusted, OSError, ValueError, TypeError, RecursionError, ImportError) as exc:
            self._drop()
            self.last = {"restored": False, "reason": f"the saved artifacts were not used ({exc}); dropped"}
            return self.last
        try:
            from torch.compiler._cache import CacheArtifactManager

            info = CacheArtifactManager.populate_caches(artifacts)
        except Exception as exc:  # noqa: BLE001 - a stale or torn cache is dropped, never fatal
            self._drop()
            self.last = {"restored": False, "reason": f"the saved artifacts could not be loaded ({exc}); dropped"}
            return self.last
        if not _count(info):  # torch read nothing it can use (another torch's format, a torn file)
            self._drop()
            self.last = {"restored": False, "reason": "the saved artifacts held nothing this torch can use; dropped"}
            return self.last
        self.last = {"restored": True, "artifacts": _count(info), "shapes": sorted(self.shapes)}
        return self.last

    def store(self, shape: str) -> bool:
        """Save what this process compiled, signed, once per new ``shape``; True when written."""
        if shape in self.shapes:
            return False
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception:  # noqa: BLE001 - saving is an optimisation
            return False
        if saved is None:  # nothing compiled by a caching backend (the eager test backend, say)
            return False
        data, info = saved
        shapes = sorted(self.shapes | {shape})
        try:
            signed = self.sign(data)
            _atomic_write(self._artifacts, data)
            _atomic_write(self._manifest, json.dumps({"shapes": shapes, "hmac": signed}).encode())
        except (OSError, Untrusted) as exc:
            self.last = {**self.last, "stored": False, "reason": str(exc)}
            return False
        self.shapes = set(shapes)
        self.last = {**self.last, "stored": True, "artifacts": _count(info), "shapes": shapes}
        return True

    def _drop(self) -> None:
        for path in (self._artifacts, self._manifest):
            with contextlib.suppress(OSError):  # another user's folder keeps its files; they are not read
                path.unlink(missing_ok=True)
        self.shapes = set()


def _count(info: Any) -> dict[str, int]:
    """How many artifacts of each kind a ``CacheInfo`` lists (inductor, aot_autograd, ...)."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items() if keys}


def _atomic_write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    os.replace(temporary, path)
