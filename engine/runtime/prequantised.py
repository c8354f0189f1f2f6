"""A denoiser stored quantised: torchao tensors in safetensors, written once and loaded as they are.

``diffusion-engine quantize`` writes a pipeline folder whose denoiser is
already int8 / fp8: its weights are torchao's tensor subclasses flattened
into plain tensors plus JSON metadata (torchao's own safetensors support,
``torchao.prototype.safetensors``: no pickle anywhere), beside a
:data:`MARKER` file saying what it is, what it was made from and for which
device (torchao's int8 is weight-only on a CPU and dynamic on a GPU).

Loading builds the model on the ``meta`` device and assigns the stored
tensors: the dense weights never exist, so there is no bf16 transient, and
no quantisation time. The marker is read torch-free by the folder preflight
(:func:`read_marker`), so the plan knows the scheme before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.preflight.quantised_folder import MARKER, STORED_SCHEMES, WEIGHTS, read_marker

_PREFIX = "model."


def save_quantised(model: Any, folder: Path, note: dict[str, Any]) -> Path:
    """Write ``model`` (quantised in place by torchao) into ``folder``: config, weights, marker."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    # Every name under one prefix: torchao splits names at their last dot, and a model may own a
    # top-level tensor (a pad token) whose name has none.
    tensors, metadata = flatten_tensor_state_dict({_PREFIX + k: v for k, v in model.state_dict().items()})
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(tensors, str(folder / WEIGHTS), metadata=metadata)
    (folder / MARKER).write_text(json.dumps(note, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def load_quantised(model_class: Any, folder: Path, dtype: Any, scheme: str | None = None) -> Any:
    """The stored model, built on ``meta`` and given the stored tensors (no dense weights ever);
    its plain floating parameters (norms, biases, kept-dense Linears) in ``dtype``; a ConvRot
    model's quantised Linears rotate their inputs again (their weights are stored rotated)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with torch.device("meta"):
        model = model_class.from_config(model_class.load_config(str(folder)))
    with safe_open(str(folder / WEIGHTS), framework="pt") as opened:
        metadata = opened.metadata() or {}
    state, leftover = unflatten_tensor_state_dict(load_file(str(folder / WEIGHTS)), metadata)
    if leftover:
        raise ValueError(f"{folder / WEIGHTS} holds tensors its metadata does not name: {sorted(leftover)[:3]}")
    model.load_state_dict({k.removeprefix(_PREFIX): v for k, v in state.items()}, strict=True, assign=True)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if type(param.data) is torch.Tensor and param.is_floating_point() and param.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(param.data.to(dtype), requires_grad=False))
    if scheme == "int8_convrot":
        from engine.runtime.convrot import restore_rotations

        restore_rotations(model, lambda module: type(module.weight.data) is not torch.Tensor)
    return model.eval().requires_grad_(False)


__all__ = ["MARKER", "STORED_SCHEMES", "WEIGHTS", "load_quantised", "read_marker", "save_quantised"]
