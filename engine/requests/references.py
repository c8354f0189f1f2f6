"""How a request writes a model, a LoRA or a dataset, told apart by syntax alone.

A model reference is a local path (a pipeline folder, a single file, a
GGUF), a checkpoint name of an installed family, or a hub repo id
(``org/name``); :meth:`engine.Engine.catalog.check_model` resolves one. These
helpers only read the text (no filesystem, no hub), so a face can confine a
path or pass a repo id on before asking the engine. The file names a request
may point at (a run's LoRA, its EMA, a dataset's images) are defined here and
read by the preflight and the trainer.
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TRUTHY = frozenset({"1", "ON", "YES", "TRUE"})
#: Set to 1 to allow downloads of hub models that are not cached (as ``--allow-download``).
ALLOW_DOWNLOAD_ENV = "DIFFUSION_ENGINE_ALLOW_DOWNLOAD"

#: The file a training run (and diffusers' ``save_lora_weights``) writes.
RUN_LORA_FILE = "pytorch_lora_weights.safetensors"
#: A two-expert run's second LoRA: in this folder of the run, loaded into the component its
#: safetensors metadata names under :data:`LORA_COMPONENT_KEY` (a run folder given as a LoRA
#: brings both).
SECOND_EXPERT_FOLDER = "low_noise"
LORA_COMPONENT_KEY = "diffusion_engine.component"
#: The EMA of a run's LoRA, saved beside it as a second adapter.
EMA_FILE = "pytorch_lora_weights_ema.safetensors"
#: The adapter files a training run's folder holds (its final LoRA, and its EMA when kept).
RUN_ADAPTER_FILES: tuple[str, ...] = (RUN_LORA_FILE, EMA_FILE)
#: The image files a dataset folder is read for.
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: The clip containers a dataset may hold.
CLIP_EXTENSIONS: tuple[str, ...] = (".mp4", ".mov", ".mkv", ".webm", ".m4v", ".avi")


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


def download_allowed_by_env() -> bool:
    """Whether ``DIFFUSION_ENGINE_ALLOW_DOWNLOAD`` says downloads are allowed (read now)."""
    return os.environ.get(ALLOW_DOWNLOAD_ENV, "").strip().upper() in TRUTHY


def download_allowed(flag: bool = False) -> bool:
    """The user's consent to a hub download: the flag, or ``DIFFUSION_ENGINE_ALLOW_DOWNLOAD=1``."""
    return flag or download_allowed_by_env()


__all__ = [
    "ALLOW_DOWNLOAD_ENV", "CLIP_EXTENSIONS", "EMA_FILE", "IMAGE_EXTENSIONS", "LORA_COMPONENT_KEY", "RUN_ADAPTER_FILES", "RUN_LORA_FILE",
    "SECOND_EXPERT_FOLDER",
    "download_allowed", "download_allowed_by_env", "is_hub_id", "looks_like_path",
]
