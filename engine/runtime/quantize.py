"""Transformer quantisation through torchao (and bitsandbytes for nf4).

Which layers a scheme takes is decided by :mod:`engine.policy.quant_filter`,
the same rule the planner sizes with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.errors import EngineError
from engine.policy.quant_filter import MIN_FEATURES, quantises


class QuantisationFailed(EngineError):
    code = "quantisation_failed"


def module_filter(scheme: str) -> Callable[[torch.nn.Module, str], bool]:
    """torchao ``filter_fn``: which Linears ``scheme`` quantises."""

    def keep(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and quantises(
            scheme, name, module.in_features, module.out_features
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

    if scheme == "int8":
        # Dynamic per-token activations on GPUs (int8 GEMMs); weight-only on CPU.
        return Int8DynamicActivationInt8WeightConfig() if device == "cuda" else Int8WeightOnlyConfig()
    if scheme == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if scheme == "mxfp8":
        from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig

        return MXDynamicActivationMXWeightConfig()
    if scheme == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        return NVFP4DynamicActivationNVFP4WeightConfig()
    raise ValueError(f"no torchao config for {scheme!r}")


def quantize_transformer(model: torch.nn.Module, scheme: str, device: str) -> int:
    """Quantise ``model`` in place; return how many Linears changed."""
    from torchao.quantization import quantize_

    keep = module_filter(scheme)
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    if not chosen:
        raise QuantisationFailed(
            f"no Linear layer of {type(model).__name__} qualifies for {scheme} "
            f"(all under {MIN_FEATURES} features or skipped)"
        )
    try:
        quantize_(model, torchao_config(scheme, device), filter_fn=keep)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as exc:
        raise QuantisationFailed(f"{scheme} quantisation failed: {exc}") from exc
    return len(chosen)


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
