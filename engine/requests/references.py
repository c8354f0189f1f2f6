"""How a request writes a model, a LoRA or a dataset, told apart by syntax alone.

A model reference is a local path (a pipeline folder, a single file, a
GGUF), a checkpoint name of an installed family, or a hub repo id
(``org/name``); :meth:`engine.Engine.check_model` resolves one. These
helpers only read the text (no filesystem, no hub), so a face can confine a
path or pass a repo id on before asking the engine.
"""

from __future__ import annotations

from engine.preflight.dataset import IMAGE_EXTENSIONS
from engine.preflight.hub import is_hub_id, looks_like_path
from engine.preflight.lora import RUN_LORA_FILE
from engine.training.levers import EMA_FILE

#: The adapter files a training run's folder holds (its final LoRA, and its EMA when kept).
RUN_ADAPTER_FILES: tuple[str, ...] = (RUN_LORA_FILE, EMA_FILE)

__all__ = ["IMAGE_EXTENSIONS", "RUN_ADAPTER_FILES", "is_hub_id", "looks_like_path"]
