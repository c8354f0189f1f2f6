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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.contract.types import StoredLayout
from engine.errors import EngineError
from engine.preflight.source import ModelSource

#: safetensors dtypes as torch's, for the meta tensors of a header.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class LayoutNotConverted(EngineError):
    """The family's converter would leave parameters unset, tensors unread or shapes wrong."""

    code = "corrupt_checkpoint"


def check_stored_layout(source: ModelSource) -> None:
    """Refuse, before anything is evicted, a folder whose stored layout the family's converter
    cannot turn into the model: converted on ``meta`` from the headers alone."""
    import diffusers

    from engine.preflight.headers import tensor_storage
    from engine.preflight.stored_layouts import layout_of_folder

    layout, folder = source.stored_layout, Path(source.location)
    if layout is None or source.kind != "pipeline":
        return
    config = diffusers.DiffusionPipeline.load_config(str(folder))
    for name in source.family.denoisers:
        if name not in config or layout_of_folder(source.family, folder / name) is None:
            continue
        shapes = {tensor: shape for tensor, shape in _header_shapes(folder / name)}
        dtypes = {tensor: dtype for tensor, dtype, _, _ in tensor_storage(sorted((folder / name).glob("*.safetensors")))}
        stored = {tensor: torch.empty(shape, dtype=_DTYPES.get(dtypes[tensor], torch.float32), device="meta")
                  for tensor, shape in shapes.items()}
        model = _empty(getattr(diffusers, config[name][1]), folder / name)
        _compare(folder / name, layout, _converter(layout)(stored, torch.bfloat16), model)


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


def _header_shapes(folder: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    from engine.preflight.headers import tensor_shapes

    yield from tensor_shapes(sorted(folder.glob("*.safetensors")))
