"""Load a single ``.safetensors`` that holds a whole pipeline (the UNet-era
checkpoints people download) with diffusers' ``from_single_file``.

Every weight comes from the file; the component configs (and tokenizers,
scheduler) come from the source's ``base``: a local diffusers folder, or a
hub repo id read from the local cache when the hub is offline
(:func:`engine.preflight.hub.hub_access_error` refuses an uncached one
before anything is evicted). No family is named here: the family table's
pipeline class decides what is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.preflight.hub import hub_offline
from engine.preflight.source import ModelSource


def load_whole_file(source: ModelSource, dtype: torch.dtype) -> Any:
    import diffusers

    pipeline_cls = getattr(diffusers, source.family.pipeline_class_of(source.checkpoint))
    config = str(source.base)
    local = Path(config).expanduser().is_dir() or hub_offline()
    return pipeline_cls.from_single_file(source.location, config=config, dtype=dtype, local_files_only=local)
