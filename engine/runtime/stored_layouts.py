"""Loading a denoiser stored in a publisher's own layout (see :mod:`engine.preflight.stored_layouts`).

The model is built with its parameters on ``meta`` (its buffers real: rotary tables are not in
any state dict), the stored tensors are read and handed to the family's converter, and the
result is loaded strictly: a parameter the conversion did not give, or a tensor it left over,
refuses the load naming them, so a layout converted wrong can never run random-initialised.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from engine.contract.types import StoredLayout
from engine.errors import EngineError


class LayoutNotConverted(EngineError):
    """The family's converter left parameters unset or tensors unread."""

    code = "load_failed"


def load_converted(model_class: Any, folder: Path, layout: StoredLayout, dtype: torch.dtype) -> Any:
    """The model at ``folder`` (stored as ``layout``), in diffusers' layout and ``dtype``."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    module, _, function = layout.convert.partition(":")
    convert = getattr(importlib.import_module(module), function)
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        stored.update(load_file(str(file)))
    state = convert(stored, dtype)
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(model_class.load_config(str(folder)))
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise LayoutNotConverted(
            f"{folder} is stored as {layout.name}, but its conversion left "
            f"{len(missing)} parameter(s) unset (e.g. {', '.join(missing[:3]) or '-'}) and "
            f"{len(extra)} tensor(s) unread (e.g. {', '.join(extra[:3]) or '-'}); the repo is not the layout "
            "it looks like: download it again, or load the dense repo"
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
