"""Transformer quantisation through torchao (and bitsandbytes for nf4), and
placing a quantised model on its device without a dense copy there.

Which layers a scheme takes is decided by :mod:`engine.policy.quant_filter`,
the same rule the planner sizes with.

Quantise on the way in. A quantised base is never resident on the GPU in
dense bf16: :func:`quantize_on_host_then_place` quantises the model one
repeated block at a time (each child of its block ``ModuleList``\\s, then the
rest) and only then moves it. Where the quantisation runs depends on what
the installed torchao (0.18) can do off the GPU:

- ``host`` (int8, and every scheme when the target is the CPU): torchao's
  int8 quantises with plain torch ops on any device, so each block is
  quantised on the CPU and only int8 weights cross to the GPU. The dense
  model is already in host memory (the loader reads it there); quantising
  it in place block by block shrinks it as it goes.
- ``device`` (fp8, mxfp8, nvfp4 on a GPU): torchao's fp8 quantisation
  asserts an sm89+ GPU when it runs and, on sm90 with its mslk kernels
  installed, quantises with a Triton kernel that needs the weight on the GPU;
  mxfp8 and nvfp4 are Blackwell formats whose quantisation kernels torchao
  picks for the GPU. Each block is moved, quantised there, and (for an
  offloaded plan) moved back, so the dense peak on the GPU is one block, not
  the model.

nf4 (bitsandbytes) quantises while ``from_pretrained`` loads, and is not
handled here. Every failure while moving or quantising, out-of-memory
included, is raised as a typed error (:class:`PlacementFailed`,
:class:`QuantisationFailed`) so the caller's planned fallback can take over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.errors import EngineError
from engine.policy.quant_filter import MIN_FEATURES, quantises

#: torchao's ``filter_fn`` / ``module_filter_fn`` signature.
ModuleFilter = Callable[[torch.nn.Module, str], bool]
#: Quantises (or swaps) the Linears of a module that a filter keeps, in place.
Transform = Callable[[torch.nn.Module, ModuleFilter], None]

#: Schemes the installed torchao quantises off the GPU (see the module doc).
HOST_SCHEMES = frozenset({"int8", "int8_convrot"})
#: Why each scheme quantises where it does; printed in the placement record.
SITE_REASONS = {
    "int8": "torchao's int8 quantises with plain torch ops, on any device",
    "int8_convrot": "ConvRot rotates and torchao's int8 quantises with plain torch ops, on any device",
    "fp8": "torchao's fp8 quantisation needs the sm89+ GPU (and, on sm90, its Triton kernel) at quantisation time",
    "mxfp8": "torchao picks mxfp8's quantisation kernels for the Blackwell GPU",
    "nvfp4": "torchao picks nvfp4's quantisation kernels for the Blackwell GPU",
}

#: Lower bound on fp8 activation scales (torchao ``activation_value_lb``).
FP8_ACTIVATION_FLOOR = 1e-12

#: Errors torchao and torch raise for a scheme a layer or machine cannot take.
_QUANT_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError, ImportError)


class QuantisationFailed(EngineError):
    code = "quantisation_failed"


class PlacementFailed(EngineError):
    """Moving weights to their device failed (out of memory, most often)."""

    code = "placement_failed"

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


@dataclass(frozen=True)
class Placement:
    """How a quantised model got to its device: the peak-relevant facts."""

    scheme: str
    layers: int
    device: str
    #: ``host``: quantised on the CPU, then moved; ``device``: each block
    #: moved, quantised on the device (and moved back unless resident).
    site: str
    #: Repeated blocks quantised one at a time, before the rest of the model.
    blocks: int
    #: Moved to ``device`` here; else left on the host for the memory mode.
    resident: bool
    why: str

    @property
    def path(self) -> str:
        """One line for logs, status and run events."""
        if self.site == "host":
            where = f"quantised {self.scheme} on the host, block by block ({self.blocks} blocks, then the rest)"
            then = f"then moved to {self.device}" if self.resident else "left on the host for the offload hooks"
        else:
            where = (
                f"quantised {self.scheme} on {self.device}, one block at a time "
                f"({self.blocks} blocks, then the rest)"
            )
            then = "kept there" if self.resident else "each moved back to the host for the offload hooks"
        return f"{where}, {then}: {self.why}"

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "path": self.path}


def module_filter(scheme: str, dense_modules: tuple[str, ...] = ()) -> ModuleFilter:
    """torchao ``filter_fn``: which Linears ``scheme`` quantises (``dense_modules``:
    the family's ``int8_dense_modules``)."""

    def keep(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and quantises(
            scheme, name, module.in_features, module.out_features, dense_modules
        )

    return keep


def torchao_config(scheme: str, device: str) -> object:
    """The torchao config object for ``scheme`` (constructible on any machine)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if scheme in ("int8", "int8_convrot"):
        # Dynamic per-token activations on GPUs (int8 GEMMs); weight-only on CPU.
        return Int8DynamicActivationInt8WeightConfig() if device == "cuda" else Int8WeightOnlyConfig()
    if scheme == "fp8":
        # Floor the activation scales where torchao can: an all-zero row
        # (a padded text stream) otherwise gets scale 0 and NaN. The
        # planner lifts a family's fp8 deny only when this floor exists.
        fields = getattr(Float8DynamicActivationFloat8WeightConfig, "__dataclass_fields__", {})
        floor = {"activation_value_lb": FP8_ACTIVATION_FLOOR} if "activation_value_lb" in fields else {}
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), **floor)
    if scheme == "mxfp8":
        from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

        return MXDynamicActivationMXWeightConfig()
    if scheme == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        return NVFP4DynamicActivationNVFP4WeightConfig()
    raise ValueError(f"no torchao config for {scheme!r}")


def torchao_transform(scheme: str, device: str) -> Transform:
    """The inference transform: torchao ``quantize_`` with the config for ``device``."""

    def apply(module: torch.nn.Module, keep: ModuleFilter) -> None:
        from torchao.quantization import quantize_

        if scheme == "int8_convrot":  # weights stored rotated, inputs rotated as they arrive
            from engine.runtime.convrot import rotate_linears

            rotate_linears(module, keep)
        quantize_(module, torchao_config(scheme, device), filter_fn=keep)

    return apply


def weight_only_config(scheme: str) -> object:
    """torchao's weight-only config for ``scheme``: weights stored quantised and
    upcast per layer, activations untouched. Text encoders use it (they run once
    per prompt at M = prompt tokens: no GEMM speed to win, no activation range
    to overflow, and no int8 matmul row minimum to trip)."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return Int8WeightOnlyConfig()
    if scheme == "fp8":
        return Float8WeightOnlyConfig()
    return torchao_config(scheme, "cuda")  # nvfp4: torchao has only the dynamic form


def weight_only_transform(scheme: str) -> Transform:
    """A :data:`Transform` quantising weight-only (see :func:`weight_only_config`)."""

    def apply(module: torch.nn.Module, keep: ModuleFilter) -> None:
        from torchao.quantization import quantize_

        quantize_(module, weight_only_config(scheme), filter_fn=keep)

    return apply


def quantize_transformer(model: torch.nn.Module, scheme: str, device: str) -> int:
    """Quantise ``model`` in place, where it lies; return how many Linears changed."""
    keep = module_filter(scheme)
    count = _count(model, keep, scheme)
    _quantise(torchao_transform(scheme, device), model, keep, scheme, device)
    return count


def quantisation_site(scheme: str, device: str) -> tuple[str, str]:
    """Where ``scheme`` quantises for a model bound for ``device``, and why."""
    if device == "cpu":
        return "host", "the target is the host"
    if scheme in HOST_SCHEMES:
        return "host", SITE_REASONS[scheme]
    return "device", SITE_REASONS.get(scheme, f"{scheme} is not known to quantise off the GPU")


def quantize_on_host_then_place(
    model: torch.nn.Module,
    scheme: str,
    device: str,
    *,
    resident: bool = True,
    transform: Transform | None = None,
    keep: ModuleFilter | None = None,
    site: str | None = None,
) -> Placement:
    """Quantise ``model`` for ``device`` one block at a time, then place it.

    ``resident``: move the quantised model to ``device`` (else leave it on the
    host, for a memory mode whose hooks place it). ``transform`` / ``keep``
    default to the inference scheme's torchao config and filter; training
    passes its own. ``site`` overrides :func:`quantisation_site` (``host`` or
    ``device``). Raises :class:`QuantisationFailed` or :class:`PlacementFailed`.
    """
    keep = keep or module_filter(scheme)
    transform = transform or torchao_transform(scheme, device)
    count = _count(model, keep, scheme)
    chosen_site, why = quantisation_site(scheme, device)
    if site is not None and site != chosen_site:
        chosen_site, why = site, "asked for by the caller"
    on_device = chosen_site == "device"
    blocks = list(repeated_blocks(model))
    for prefix, block in blocks:
        if on_device:
            move_to(block, device, f"block {prefix}")
        _quantise(transform, block, _prefixed(keep, prefix), scheme, device)
        if on_device and not resident:
            move_to(block, "cpu", f"block {prefix}")
    with _without_block_lists(model, {prefix.split(".")[0] for prefix, _ in blocks}):
        if on_device:
            move_to(model, device, "the layers outside the repeated blocks")
        _quantise(transform, model, keep, scheme, device)
        if on_device and not resident:
            move_to(model, "cpu", "the layers outside the repeated blocks")
    if resident:
        move_to(model, device, f"the {scheme} model")
    return Placement(scheme, count, device, chosen_site, len(blocks), resident, why)


def repeated_blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, block)`` for each child of the model's block ``ModuleList``\\s.

    A block list is a direct child ``ModuleList`` holding no bare Linear (a
    list of Linears is left to "the rest", so a module-swapping transform can
    replace them through their parent).
    """
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList) and len(child) and not any(
            isinstance(block, torch.nn.Linear) for block in child
        ):
            for index, block in enumerate(child):
                yield f"{name}.{index}", block


def move_to(module: Any, device: str, what: str) -> None:
    """``module.to(device)``, every failure raised as :class:`PlacementFailed`.

    The one call through which quantised and resident weights move, so a
    failure to place (CUDA out of memory above all) reaches the caller's
    fallback with its reason.
    """
    with placing(what, device):
        module.to(device)


@contextlib.contextmanager
def placing(what: str, device: str) -> Iterator[None]:
    """Raise any failure of the placement in the block as :class:`PlacementFailed`
    (``.to``, offload hooks): out of memory first, then torch's and
    diffusers' errors for a device or layout that cannot take the weights."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise PlacementFailed(
            f"ran out of memory moving {what} to {device} ({first_line(exc)})", out_of_memory=True
        ) from exc
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as exc:
        raise PlacementFailed(f"moving {what} to {device} failed ({first_line(exc)})") from exc


def _count(model: torch.nn.Module, keep: ModuleFilter, scheme: str) -> int:
    count = sum(1 for name, module in model.named_modules() if keep(module, name))
    if not count:
        raise QuantisationFailed(
            f"no Linear layer of {type(model).__name__} qualifies for {scheme} "
            f"(all under {MIN_FEATURES} features or skipped)"
        )
    return count


def _quantise(transform: Transform, module: torch.nn.Module, keep: ModuleFilter, scheme: str, device: str) -> None:
    try:
        transform(module, keep)
    except torch.OutOfMemoryError as exc:
        raise PlacementFailed(
            f"ran out of memory quantising {scheme} on {device} ({first_line(exc)})", out_of_memory=True
        ) from exc
    except _QUANT_ERRORS as exc:
        raise QuantisationFailed(f"{scheme} quantisation failed: {first_line(exc)}") from exc


def _prefixed(keep: ModuleFilter, prefix: str) -> ModuleFilter:
    """``keep`` asked with names as the whole model spells them (``blocks.3.attn.to_q``),
    so a block decides exactly as the whole-model call would."""

    def keep_in_block(module: torch.nn.Module, name: str) -> bool:
        return keep(module, f"{prefix}.{name}" if name else prefix)

    return keep_in_block


@contextlib.contextmanager
def _without_block_lists(model: torch.nn.Module, names: set[str]) -> Iterator[None]:
    """The model with its block lists swapped for empty ones, so a move or a
    quantisation of "the rest" touches nothing inside the blocks."""
    saved = {name: model._modules[name] for name in names}
    for name in names:
        model._modules[name] = torch.nn.ModuleList()
    try:
        yield
    finally:
        model._modules.update(saved)


def first_line(exc: BaseException) -> str:
    """An error's first line (torch's CUDA OOM message runs on for a paragraph)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def nf4_config(compute_dtype: torch.dtype) -> object:
    """diffusers' bitsandbytes 4-bit config (loading with it needs CUDA)."""
    from diffusers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=False,
    )


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes the parameters and buffers hold, quantised tensors included."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        total += _tensor_bytes(tensor)
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = inner()
        return sum(_tensor_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()
