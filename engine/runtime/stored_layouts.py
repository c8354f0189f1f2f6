"""Loading a denoiser stored in a publisher's own layout (see :mod:`engine.preflight.stored_layouts`).

The family's converter is run twice. Before anything is evicted (:func:`check_stored_layout`) it
is run on ``meta`` tensors of the stored shapes, read from the headers, and what it gives is
compared with the model's own parameters built on ``meta``: a parameter the conversion would
leave unset, a tensor it would leave unread, or a shape that differs refuses the load, naming
them. At load (:func:`load_converted`) it runs on the stored tensors, and the result is loaded
strictly, so a layout converted wrong can never run random-initialised.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.contract.types import FamilySpec, StoredLayout
from engine.errors import EngineError
from engine.preflight.source import ModelSource

class LayoutNotConverted(EngineError):
    """The family's converter would leave parameters unset, tensors unread or shapes wrong."""

    code = "corrupt_checkpoint"


def stored_denoisers(family: FamilySpec, root: Path) -> dict[str, tuple[StoredLayout, list[Any], Any]]:
    """Each denoiser of the pipeline at ``root`` stored in one of the family's layouts, with its
    tensors' (name, dtype, shape) from its headers (read once here) and its diffusers class."""
    import diffusers

    from engine.preflight.headers import tensor_layout
    from engine.preflight.stored_layouts import layout_of_names

    config = diffusers.DiffusionPipeline.load_config(str(root))
    found = {}
    for name in family.denoisers:
        if name not in config:
            continue
        rows = [row for file in sorted((root / name).glob("*.safetensors")) for row in tensor_layout(file)]
        layout = layout_of_names(family, (tensor for tensor, _, _ in rows))
        if layout is not None:
            found[name] = (layout, rows, getattr(diffusers, config[name][1]))
    return found


def check_stored_layout(source: ModelSource) -> None:
    """Refuse, before anything is evicted, a folder whose stored layout the family's converter
    cannot turn into the model: converted on ``meta`` tensors of the stored shapes (the values
    never matter to which names and shapes come out)."""
    folder = Path(source.location)
    if source.stored_layout is None or source.kind != "pipeline":
        return
    for name, (layout, rows, model_class) in stored_denoisers(source.family, folder).items():
        stored = {tensor: torch.empty(shape, device="meta") for tensor, _, shape in rows}
        model = _empty(model_class, folder / name)
        _compare(folder / name, layout, _converter(layout)(stored, torch.bfloat16), model)


def converted_denoisers(source: ModelSource, root: Path, dtype: torch.dtype) -> dict[str, Any]:
    """The denoisers a folder stores in a publisher's own layout, converted into diffusers' and
    loaded strictly; read from the headers at load too, so a hub download is converted as a
    local folder is (never loaded random-initialised)."""
    family = source.family
    if not family.quantisation.stored_layouts or source.kind not in ("pipeline", "hub"):
        return {}
    if not root.is_dir():  # a hub repo: its denoisers fetched (or found in the cache) first
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(str(root), allow_patterns=["model_index.json",
                                                                 *(f"{name}/*" for name in family.denoisers)]))
    return {name: load_converted(model_class, root / name, layout, dtype)
            for name, (layout, _, model_class) in stored_denoisers(family, root).items()}


def load_converted(model_class: Any, folder: Path, layout: StoredLayout, dtype: torch.dtype) -> Any:
    """The model at ``folder`` (stored as ``layout``), in diffusers' layout and ``dtype``."""
    from safetensors.torch import load_file

    stored: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        stored.update(load_file(str(file)))
    state = _converter(layout)(stored, dtype)
    model = _empty(model_class, folder)
    _compare(folder, layout, state, model)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _converter(layout: StoredLayout) -> Callable[[dict[str, torch.Tensor], torch.dtype], dict[str, torch.Tensor]]:
    module, _, function = layout.convert.partition(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def _empty(model_class: Any, folder: Path) -> Any:
    """The model from its config, its parameters on ``meta`` (its buffers real: a rotary table
    is in no state dict)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_class.from_config(model_class.load_config(str(folder)))


def _compare(folder: Path, layout: StoredLayout, state: dict[str, torch.Tensor], model: Any) -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(name for name in set(expected) & set(state) if tuple(state[name].shape) != expected[name])
    if missing or extra or wrong:
        raise LayoutNotConverted(
            f"{folder} is stored as {layout.name}, but its conversion leaves {len(missing)} parameter(s) unset "
            f"(e.g. {', '.join(missing[:3]) or '-'}), {len(extra)} tensor(s) unread (e.g. {', '.join(extra[:3]) or '-'}) "
            f"and {len(wrong)} of another shape (e.g. {', '.join(wrong[:3]) or '-'}); the repo is not the layout it "
            "looks like: download it again, or load the dense repo"
        )

