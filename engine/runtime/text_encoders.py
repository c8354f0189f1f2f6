"""Text encoders as the plan says: quantised weight-only, and streamed when asked.

Quantisation goes through the denoiser's path
(:func:`engine.runtime.quantize.quantize_on_host_then_place`) with torchao's
weight-only configs and the same layer filter, so the bytes the planner
sizes are the bytes built; nf4 is bitsandbytes at load time (transformers'
own 4-bit config, CUDA only).

A pre-cast encoder (an fp8 T5 download, planned ``fp8`` "as stored") is
loaded as the pipeline loads it (upcast on the host), then its stored fp8
matrices are put back from its files and each of those Linears upcasts its
weight per call (:func:`hold_precast`): the device holds the file's own
values, 1 byte a parameter, never quantised a second time.

Streaming (``text_encoder_memory=streamed``) keeps the denoiser resident on
a card that cannot hold the encoders beside it: before each pipeline call
the encoders are placed on the device (or, on the CPU, where host memory
is the scarce pool, loaded from the pipeline folder again), and the moment
the denoiser's first forward begins they are freed: moved back to the host
on a GPU, deleted on the CPU.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.policy.encoders import PrecastEncoders
from engine.runtime import quantize
from engine.runtime.quantize import Placement, QuantisationFailed

#: Components of a diffusers pipeline that are text encoders.
ENCODER_PREFIX = "text_encoder"


def encoder_names(pipe: Any) -> list[str]:
    """The pipeline's loaded text-encoder components, in order."""
    return [
        name for name, component in pipe.components.items()
        if name.startswith(ENCODER_PREFIX) and isinstance(component, torch.nn.Module)
    ]


def quantize_text_encoders(
    pipe: Any, scheme: str, device: str, *, resident: bool, int8_keep: tuple[str, ...] = ()
) -> list[Placement]:
    """Hold every text encoder in ``scheme``, in place; place it when ``resident``.

    ``int8_keep``: the family's keep-in-bf16 schedule (name fragments int8 leaves dense).

    :raises QuantisationFailed: an encoder has no layer the scheme takes
        (the caller keeps the encoders dense and records why).
    :raises PlacementFailed: moving or quantising ran out of memory.
    """
    placements, skipped = [], []
    for name in encoder_names(pipe):
        try:
            placements.append(quantize_encoder(getattr(pipe, name), scheme, device, resident=resident,
                                               int8_keep=int8_keep))
        except QuantisationFailed as exc:  # a small encoder (CLIP-L beside T5) may have no layer to take
            skipped.append(f"{name}: {exc.message}")
    if not placements:
        raise QuantisationFailed("; ".join(skipped) or "the pipeline has no text encoder")
    return placements


def quantize_encoder(
    encoder: torch.nn.Module, scheme: str, device: str, *, resident: bool, int8_keep: tuple[str, ...] = ()
) -> Placement:
    """One encoder, through the denoiser's block-by-block path: layerwise ``fp8`` (weights
    stored in e4m3, upcast per call: plain tensors), torchao's dynamic fp8 with the
    activation floor (``fp8_dynamic``), or torchao weight-only ``int8`` / ``nvfp4``."""
    layout = "fp8" if scheme in ("fp8", "fp8_dynamic") else scheme
    takes = quantize.module_filter(layout, int8_keep if scheme == "int8" else ())
    # Modules the model class keeps in fp32 (T5's ``wo``: its forward casts the input to that weight's dtype).
    fp32 = set(getattr(encoder, "_keep_in_fp32_modules", None) or ())

    def keep(module: torch.nn.Module, name: str) -> bool:
        return takes(module, name) and not fp32.intersection(name.split("."))

    if scheme == "fp8":
        transform = layerwise_fp8
    elif scheme == "fp8_dynamic":
        transform = quantize.torchao_transform("fp8", device)
    else:
        transform = quantize.weight_only_transform(scheme)
    return quantize.quantize_on_host_then_place(
        encoder, scheme, device, resident=resident, transform=transform, keep=keep,
        site="host" if scheme in ("int8", "fp8") or device == "cpu" else None,
    )


def layerwise_fp8(module: torch.nn.Module, keep: Callable[[torch.nn.Module, str], bool]) -> None:
    """Store the weights of ``module``'s kept Linears in float8 (e4m3), each upcasting its
    weight to the input's dtype at every call: half the bytes, plain tensors (they move
    with ``Module.to``, so offload and streaming work), no kernel beyond a cast."""
    for name, linear in list(module.named_modules()):
        if isinstance(linear, torch.nn.Linear) and keep(linear, name):
            stored = linear.weight.detach().to(torch.float8_e4m3fn)
            linear.weight = torch.nn.Parameter(stored, requires_grad=False)
            linear.forward = _upcasting_forward(linear)  # type: ignore[method-assign]


def nf4_encoder_components(root: str, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Text encoders loaded 4-bit by bitsandbytes (needs CUDA), for ``from_pretrained``."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
    )
    return {
        name: _encoder_class(config[name]).from_pretrained(
            root, subfolder=name, dtype=dtype, quantization_config=quantization,
        )
        for name in config
        if name.startswith(ENCODER_PREFIX) and isinstance(config[name], (list, tuple)) and config[name][0]
    }


def _encoder_class(entry: Any) -> Any:
    library, name = entry[0], entry[1]
    return getattr(importlib.import_module(library), name)


def hold_precast(encoder: torch.nn.Module, files: list[Path], dtype: str = "F8_E4M3") -> int:
    """Put ``encoder``'s Linear weights stored in ``dtype`` back as stored (the
    encoder was loaded upcast), each such Linear upcasting its weight to the
    input's dtype per call; returns how many. The values are the file's own:
    an fp8 value upcast is exact, so the outputs equal the upcast encoder's.
    Modules the model class keeps in fp32 stay upcast."""
    from safetensors import safe_open

    # Modules the model keeps in fp32 (T5's ``wo``: its forward casts the input to that weight's dtype).
    keep = set(getattr(encoder, "_keep_in_fp32_modules", None) or ())
    linears = {
        name: m for name, m in encoder.named_modules()
        if isinstance(m, torch.nn.Linear) and not keep.intersection(name.split("."))
    }
    held = 0
    for file in files:
        with safe_open(str(file), framework="pt") as stored:
            for key in stored.keys():
                module = linears.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
                if module is None or stored.get_slice(key).get_dtype() != dtype:
                    continue
                weight = stored.get_tensor(key)
                if weight.shape != module.weight.shape:
                    continue
                module.weight = torch.nn.Parameter(weight.to(module.weight.device), requires_grad=False)
                module.forward = _upcasting_forward(module)  # type: ignore[method-assign]
                held += 1
    return held


def _upcasting_forward(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        bias = module.bias.to(inputs.dtype) if module.bias is not None else None
        return torch.nn.functional.linear(inputs, module.weight.to(inputs.dtype), bias)

    return forward


def _encoder_files(root: str, name: str) -> list[Path]:
    return sorted((Path(root) / name).glob("*.safetensors"))


def prepare_encoders(
    pipe: Any, denoiser: torch.nn.Module, plan: Any, root: str, dtype: torch.dtype, *, resident: bool,
    precast: PrecastEncoders | None = None, int8_schedule: tuple[str, ...] | None = None,
) -> tuple[EncoderStream | None, list[Placement], str | None]:
    """Quantise the encoders as ``plan`` says and set up streaming.

    Returns the stream (None unless ``text_encoder_memory`` is streamed), the
    encoders' placements, and why the planned scheme could not be applied
    (None when it was): an encoder with no layer the scheme takes stays dense.
    ``precast`` (:class:`~engine.policy.encoders.PrecastEncoders`): where the
    plan keeps its scheme, those encoders are held as stored and none is
    quantised (the plan sized the others as stored too).

    :raises PlacementFailed: out of memory while quantising or moving.
    """
    scheme = str(plan.value("text_encoder_quant", "none"))
    streamed = plan.value("text_encoder_memory") == "streamed"
    int8_keep = tuple(int8_schedule or ())
    placements: list[Placement] = []
    failure = None
    as_stored = tuple(precast.encoders) if precast is not None and scheme == precast.scheme else ()
    for name in as_stored:
        if getattr(pipe, name, None) is not None:
            hold_precast(getattr(pipe, name), _encoder_files(root, name), precast.dtype)
    if scheme not in ("none", "nf4") and not as_stored:
        try:
            placements = quantize_text_encoders(pipe, scheme, plan.device, resident=resident and not streamed,
                                                int8_keep=int8_keep)
        except QuantisationFailed as exc:
            failure = f"{scheme} could not be applied to the text encoders ({exc.message}); they run dense"
    if not streamed:
        return None, placements, failure
    def reload(name: str) -> torch.nn.Module:
        encoder = load_encoder(root, name, stream.entry(name), dtype)
        if name in as_stored:
            hold_precast(encoder, _encoder_files(root, name), precast.dtype)
        elif scheme not in ("none", "nf4") and failure is None and not as_stored:
            quantize_encoder(encoder, scheme, plan.device, resident=False, int8_keep=int8_keep)
        return encoder

    stream = EncoderStream(pipe, denoiser, plan.device, reload)
    return stream, placements, failure


class EncoderStream:
    """Places the encoders before a call and frees them before denoising.

    ``reload`` builds one encoder again by component name (read from the
    pipeline folder, quantised as planned); used where freeing means
    deleting (the device is the host).
    """

    def __init__(
        self, pipe: Any, denoiser: torch.nn.Module, device: str,
        reload: Callable[[str], torch.nn.Module],
    ) -> None:
        self._pipe = pipe
        self._denoiser = denoiser
        self._device = device
        self._reload = reload
        self.names = encoder_names(pipe)
        self._classes = {name: tuple(pipe.config[name]) for name in self.names}
        self._hook: Any = None
        #: The pipeline of the running call (a workflow's, sharing components).
        self._active: Any = pipe
        #: Encoder loads and frees since load (for status).
        self.loads = 0
        self.frees = 0

    @property
    def deletes(self) -> bool:
        """On the host there is nowhere to move an encoder to: freeing deletes it."""
        return self._device == "cpu"

    def release_now(self, pipe: Any = None) -> None:
        """Free the encoders outside a call's encoding: right after load, or for
        a call whose prompt embeddings came from disk (``pipe``: a workflow
        pipeline over the same components, whose references go too)."""
        self._active = self._pipe if pipe is None else pipe
        self._free()

    def entry(self, name: str) -> tuple[str, str]:
        """``(library, class)`` of an encoder, as the pipeline folder names it."""
        return self._classes[name]  # type: ignore[return-value]

    def before_call(self, pipe: Any = None) -> None:
        """Bring the encoders in (into ``pipe`` too: a workflow pipeline over the
        same components) and arm the free for the denoiser's first forward."""
        self._active = self._pipe if pipe is None else pipe
        for name in self.names:
            encoder = getattr(self._pipe, name, None)
            if encoder is None:
                encoder = self._reload(name)
                setattr(self._pipe, name, encoder)
                self.loads += 1
            if self._active is not self._pipe:
                setattr(self._active, name, encoder)
            quantize.move_to(encoder, self._device, f"the text encoder {name}")
        if self._hook is None:
            self._hook = self._denoiser.register_forward_pre_hook(self._on_denoise, prepend=True)

    def after_call(self) -> None:
        """Disarm (the call may have ended before denoising) and free what is left."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._free()

    def _on_denoise(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._free()

    def _free(self) -> None:
        freed = False
        for name in self.names:
            encoder = getattr(self._pipe, name, None)
            if encoder is None:
                continue
            if self.deletes:
                setattr(self._pipe, name, None)
                if self._active is not self._pipe and getattr(self._active, name, None) is not None:
                    setattr(self._active, name, None)
                del encoder
            else:
                quantize.move_to(encoder, "cpu", f"the text encoder {name}")
            freed = True
        if freed:
            self.frees += 1
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def status(self) -> dict[str, object]:
        return {"encoders": list(self.names), "loads": self.loads, "frees": self.frees,
                "frees_by": "deleting" if self.deletes else "moving to the host"}


def keep_on_host(pipe: Any, device: str) -> list[str]:
    """``text_encoder_memory=host``: the encoders stay in host memory and run on the CPU while the
    rest computes on ``device``. A pipeline that hands an encoder its token ids on the execution
    device, or uses its output there without moving it, still works: each encoder takes its
    inputs on the host and gives its outputs back on ``device`` (accelerate's ``send_to_device``
    walks the nested arguments and keeps a model output its own class). The encoders' names."""
    from accelerate.utils import send_to_device

    names = encoder_names(pipe)
    for name in names:
        encoder = getattr(pipe, name)
        quantize.move_to(encoder, "cpu", f"the text encoder {name}")
        encoder.register_forward_pre_hook(lambda _module, args, kwargs: send_to_device((args, kwargs), "cpu"),
                                          with_kwargs=True)
        encoder.register_forward_hook(lambda _module, _args, output: send_to_device(output, device))
    return names


def load_encoder(root: str, name: str, entry: tuple[str, str], dtype: torch.dtype) -> torch.nn.Module:
    """One text encoder from a pipeline folder (or hub cache), in ``dtype``."""
    encoder = _encoder_class(entry).from_pretrained(root, subfolder=name, dtype=dtype)
    encoder.requires_grad_(False)
    encoder.eval()
    return encoder


__all__ = [
    "EncoderStream",
    "QuantisationFailed",
    "encoder_names",
    "hold_precast",
    "keep_on_host",
    "load_encoder",
    "nf4_encoder_components",
    "prepare_encoders",
    "quantize_text_encoders",
]
