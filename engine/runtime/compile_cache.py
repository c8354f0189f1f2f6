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
generate. torch deserialises these artifacts as it does its own inductor
cache (``/tmp/torchinductor_$USER``): they are trusted as the user's own
files, so they live only in the user's data folder, which no route of the
server writes to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KILL_SWITCH = "DIFFUSION_ENGINE_COMPILE_CACHE"


def cache_folder() -> Path:
    """``compile-cache`` beside the runs folder (``$DIFFUSION_ENGINE_HOME``, else the per-user data folder)."""
    from engine.training.records import default_runs_dir

    return default_runs_dir().parent / "compile-cache"


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
        with contextlib.suppress(OSError, ValueError, TypeError):
            cache.shapes = set(json.loads(cache._manifest.read_text(encoding="utf-8"))["shapes"])
        return cache

    @property
    def _artifacts(self) -> Path:
        return self.folder / f"{self.key}.bin"

    @property
    def _manifest(self) -> Path:
        return self.folder / f"{self.key}.json"

    def restore(self) -> dict[str, object]:
        """Hand torch the saved artifacts before compiling; what was loaded (or why nothing)."""
        if not self._artifacts.is_file():
            self.last = {"restored": False, "reason": "no saved artifacts for this model and machine yet"}
            return self.last
        try:
            info = torch.compiler.load_cache_artifacts(self._artifacts.read_bytes())
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
        """Save what this process compiled, once per new ``shape``; True when written."""
        if shape in self.shapes:
            return False
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception:  # noqa: BLE001 - saving is an optimisation
            return False
        if saved is None:  # nothing compiled by a caching backend (the eager test backend, say)
            return False
        data, info = saved
        self.shapes.add(shape)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(self._artifacts, data)
            _atomic_write(self._manifest, json.dumps({"shapes": sorted(self.shapes)}).encode())
        except OSError:
            return False
        self.last = {**self.last, "stored": True, "artifacts": _count(info), "shapes": sorted(self.shapes)}
        return True

    def _drop(self) -> None:
        for path in (self._artifacts, self._manifest):
            path.unlink(missing_ok=True)
        self.shapes = set()


def _count(info: Any) -> dict[str, int]:
    """How many artifacts of each kind a ``CacheInfo`` lists (inductor, aot_autograd, ...)."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items() if keys}


def _atomic_write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
