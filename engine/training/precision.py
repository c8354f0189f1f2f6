"""The frozen base's precision, set up after the LoRA adapter is added.

- nf4: the denoiser is loaded through bitsandbytes 4-bit (CUDA).
- bf16: dense; regional compile with dynamic shapes when armed.
- int8: torchao weight-only int8 on the frozen Linears, applied after
  ``add_adapter`` (quantising first trips peft's torchao LoRA layer); eager.
- fp8: torchao ``convert_to_float8_training`` on the frozen Linears with
  ``pad_inner_dim``; the filter skips ``lora_*`` modules, ``proj_out`` and
  dims not divisible by 16.
- mxfp8: likewise with the MX recipe: dims divisible by 32, no biased Linears
  (``MXLinearConfig`` where torchao has it, else its successor
  ``MXFP8TrainingOpConfig``).

Quantise on the way in: :func:`place_base` sets the precision up on the
host, one repeated block at a time, and only then moves the denoiser to the
device (:func:`engine.runtime.quantize.quantize_on_host_then_place`), so an
int8 base never sits on the GPU in dense bf16. Every mode converts on the
host: int8 quantises with plain torch ops, and the fp8 / mxfp8 training
recipes swap modules (or wrap weights) without a kernel. Those two keep the
frozen weights in bf16 by design (they cast per forward), so their base is
dense on the GPU whatever the order.

During the run SDPA is pinned to flash / memory-efficient attention (the
cuDNN backend fails on some DiT training shapes) and restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from engine.errors import EngineError
from engine.hardware.profile import NATIVE_BF16_MIN_CAPABILITY, Vendor, native_bf16
from engine.policy.quant_filter import quantises
from engine.contract.schemes import SCHEMES, TORCHAO_SCHEMES
from engine.runtime.quantize import ModuleFilter, Placement, Transform, move_to, quantize_on_host_then_place

#: Base precisions that change the frozen Linears after the adapter is added: the
#: trainable schemes torchao builds (engine.contract.schemes).
CONVERTED_MODES = tuple(name for name in TORCHAO_SCHEMES if SCHEMES[name].trainable)


def _frozen_linear(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and "lora_" not in name and not any(
        p.requires_grad for p in module.parameters()
    )


def fp8_training_filter(multiple: int = 16, *, allow_bias: bool = True) -> Callable[[torch.nn.Module, str], bool]:
    """torchao float8 ``module_filter_fn``: frozen Linears with friendly dims."""

    def keep(module: torch.nn.Module, name: str) -> bool:
        if not _frozen_linear(name, module) or name.endswith("proj_out"):
            return False
        if not allow_bias and module.bias is not None:  # type: ignore[union-attr]
            return False
        return module.in_features % multiple == 0 and module.out_features % multiple == 0  # type: ignore[union-attr]

    return keep


def int8_training_filter(module: torch.nn.Module, name: str) -> bool:
    return _frozen_linear(name, module) and quantises(
        "int8", name, module.in_features, module.out_features  # type: ignore[union-attr]
    )


def apply_base_precision(denoiser: torch.nn.Module, mode: str) -> int:
    """Convert the frozen base of ``denoiser`` for ``mode`` where it lies; return layers changed."""
    if mode not in CONVERTED_MODES:
        return 0
    transform, keep = base_transform(mode)
    chosen = sum(1 for name, module in denoiser.named_modules() if keep(module, name))
    transform(denoiser, keep)
    return chosen


def place_base(denoiser: torch.nn.Module, mode: str, device: str) -> Placement | None:
    """Set the base precision up on the host, block by block, then move the
    denoiser to ``device``. Returns how it was placed (None: nothing to convert).

    Raises :class:`~engine.runtime.quantize.QuantisationFailed` or
    :class:`~engine.runtime.quantize.PlacementFailed` (out of memory included).
    """
    if mode not in CONVERTED_MODES:
        move_to(denoiser, device, f"the {mode} denoiser")
        return None
    transform, keep = base_transform(mode)
    return quantize_on_host_then_place(denoiser, mode, device, transform=transform, keep=keep, site="host")


def base_transform(mode: str) -> tuple[Transform, ModuleFilter]:
    """The in-place conversion of ``mode`` and the filter of the Linears it takes."""
    if mode == "int8":
        return _int8_transform, int8_training_filter
    if mode == "fp8":
        return _fp8_transform, fp8_training_filter(16)
    if mode == "mxfp8":
        return _mxfp8_transform, fp8_training_filter(32, allow_bias=False)
    raise ValueError(f"no base conversion for {mode!r}")


def _int8_transform(module: torch.nn.Module, keep: ModuleFilter) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(module, Int8WeightOnlyConfig(), filter_fn=keep)


def _fp8_transform(module: torch.nn.Module, keep: ModuleFilter) -> None:
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(module, module_filter_fn=keep, config=fp8_training_config())


def fp8_training_config() -> object:
    """torchao's float8 training config with ``pad_inner_dim``: the scaled-mm
    kernel needs the inner (reduction) dim a multiple of 16, and activations
    whose token count is not (odd image sizes, packed sequences) are padded
    rather than failing mid-run."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(pad_inner_dim=True)


def _mxfp8_transform(module: torch.nn.Module, keep: ModuleFilter) -> None:
    from torchao.quantization import quantize_

    quantize_(module, mxfp8_training_config(), filter_fn=keep)


def mxfp8_training_config() -> object:
    """torchao's MX training config: ``MXLinearConfig`` (up to 0.1x), renamed
    ``MXFP8TrainingOpConfig`` (weights wrapped, matmuls cast per call) in 0.18."""
    try:
        from torchao.prototype.mx_formats import MXLinearConfig  # type: ignore[attr-defined]
    except ImportError:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

        return MXFP8TrainingOpConfig()
    return MXLinearConfig()


class MachineMismatch(EngineError):
    """The trainer process runs on a machine the plan was not made for (an
    engine told ``hardware=<preset>``, or a plan carried to another host)."""

    code = "trainer_machine_mismatch"


def machine_error(
    *,
    plan_device: str,
    compute_dtype: str,
    family_label: str,
    cuda_available: bool,
    vendor: Vendor,
    capability: tuple[int, int] | None,
    torch_reports_bf16: bool,
    device_name: str,
) -> MachineMismatch | None:
    """Why the machine the trainer actually runs on cannot run ``plan_device`` /
    ``compute_dtype``, or None. Pure, so presets can stand in for the card.

    NVIDIA bf16 is native from compute capability 8.0; torch's own answer
    counts the emulation pre-Ampere cards do, which the trainer cannot use.
    """
    if plan_device != "cuda":
        return None
    if not cuda_available:
        return MachineMismatch(
            f"the run was planned for a CUDA GPU, but the trainer process sees none on this machine "
            f"({device_name}). Plan it here (leave hardware to the probe) or pass device=cpu."
        )
    if compute_dtype == "bf16" and not native_bf16(vendor, capability, torch_reports_bf16):
        where = f"sm{capability[0]}{capability[1]}" if capability else "capability unknown"
        return MachineMismatch(
            f"{family_label} LoRA training computes in bf16, and the GPU this trainer runs on, "
            f"{device_name} ({where}), has no native bf16 (it needs compute capability "
            f"{NATIVE_BF16_MIN_CAPABILITY[0]}.{NATIVE_BF16_MIN_CAPABILITY[1]}+); the plan was made for "
            "another machine. Plan the run on this machine, or train on an Ampere or newer GPU.",
            code="no_native_bf16",
        )
    return None


def check_this_machine(plan_device: str, compute_dtype: str, family_label: str) -> None:
    """Raise :class:`MachineMismatch` when this process's own device cannot run
    the plan; called by the trainer before it loads anything."""
    if plan_device != "cuda":
        return
    available = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if available else None
    error = machine_error(
        plan_device=plan_device,
        compute_dtype=compute_dtype,
        family_label=family_label,
        cuda_available=available,
        vendor="rocm" if getattr(torch.version, "hip", None) else "nvidia",
        capability=capability,
        torch_reports_bf16=available and torch.cuda.is_bf16_supported(),
        device_name=torch.cuda.get_device_name() if available else "no CUDA device",
    )
    if error is not None:
        raise error


@contextlib.contextmanager
def pinned_sdpa(device: str) -> Iterator[None]:
    """Flash / memory-efficient SDPA only, on CUDA, for the duration of a run."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield


@contextlib.contextmanager
def rms_norm_patch() -> Iterator[bool]:
    """Route diffusers' RMSNorm through ``F.rms_norm`` for the run, then put it back.

    A fused kernel instead of four eager ops. Yields False, and patches
    nothing, on torch builds without ``F.rms_norm``, rather than failing at
    forward time.
    """
    functional = torch.nn.functional
    if not hasattr(functional, "rms_norm"):
        yield False
        return
    from diffusers.models import normalization

    norm = normalization.RMSNorm
    original = norm.forward

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "weight", None)
        if getattr(self, "bias", None) is not None or (weight is not None and weight.dtype != hidden_states.dtype):
            return original(self, hidden_states)
        return functional.rms_norm(hidden_states, self.dim, weight, self.eps)  # type: ignore[arg-type]

    norm.forward = forward  # type: ignore[method-assign]
    try:
        yield True
    finally:
        norm.forward = original  # type: ignore[method-assign]
