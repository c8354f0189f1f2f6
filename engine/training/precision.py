"""The frozen base's precision, set up after the LoRA adapter is added.

- nf4: the denoiser is loaded through bitsandbytes 4-bit (CUDA).
- bf16: dense; regional compile with dynamic shapes when armed.
- int8: torchao weight-only int8 on the frozen Linears, applied after
  ``add_adapter`` (quantising first trips peft's torchao LoRA layer); eager.
- fp8: torchao ``convert_to_float8_training`` on the frozen Linears; the
  filter skips ``lora_*`` modules, ``proj_out`` and dims not divisible by 16.
- mxfp8: likewise with the MX recipe: dims divisible by 32, no biased Linears.

During the run SDPA is pinned to flash / memory-efficient attention (the
cuDNN backend fails on some DiT training shapes) and restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from engine.policy.quant_filter import quantises


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
    """Quantise the frozen base of ``denoiser`` for ``mode``; return layers changed."""
    if mode == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        chosen = [n for n, m in denoiser.named_modules() if int8_training_filter(m, n)]
        quantize_(denoiser, Int8WeightOnlyConfig(), filter_fn=int8_training_filter)
        return len(chosen)
    if mode == "fp8":
        from torchao.float8 import convert_to_float8_training

        keep = fp8_training_filter(16)
        chosen = [n for n, m in denoiser.named_modules() if keep(m, n)]
        convert_to_float8_training(denoiser, module_filter_fn=keep)
        return len(chosen)
    if mode == "mxfp8":
        from torchao.prototype.mx_formats import MXLinearConfig
        from torchao.quantization import quantize_

        keep = fp8_training_filter(32, allow_bias=False)
        chosen = [n for n, m in denoiser.named_modules() if keep(m, n)]
        quantize_(denoiser, MXLinearConfig(), filter_fn=keep)
        return len(chosen)
    return 0


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
