"""The plan's CPU GEMM kernel, applied: fp32 ``nn.Linear`` layers routed through oneDNN.

Where the probe measured oneDNN's fp32 GEMM well ahead of MKL's (a Zen 5: 161-168
GFLOP/s per core against 72-82), the plan's ``cpu_kernel`` is ``onednn`` and every
fp32 Linear of the pipeline runs :func:`~engine.hardware.gemm.onednn_linear` on its own
weight: no packed copy is held, the weight stays the module's parameter (LoRA
adapters wrap the layer as before), and the result is the same product to fp32
rounding. bf16 needs nothing: torch already sends bf16 GEMMs to oneDNN.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch

from engine.hardware.gemm import onednn_available, onednn_linear


def route_linears_to_onednn(pipe: Any) -> int:
    """Route every fp32 CPU ``nn.Linear`` of ``pipe``'s modules through oneDNN; the count routed."""
    if not onednn_available():
        return 0
    routed = 0
    for component in getattr(pipe, "components", {}).values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, torch.nn.Linear) and _plain(weight)
                    and weight.dtype == torch.float32 and weight.device.type == "cpu"):
                module.forward = OnednnForward(module)  # type: ignore[method-assign]
                routed += 1
    return routed


def _plain(weight: object) -> TypeGuard[torch.nn.Parameter]:
    """A dense parameter: not a quantised tensor subclass (torchao's Int8Tensor and kin
    dispatch ``F.linear`` to their own kernels and have no oneDNN op)."""
    return type(weight) is torch.nn.Parameter


class OnednnForward:
    """A Linear's forward through oneDNN, falling back to torch's own where oneDNN cannot
    take the call (gradients wanted, an input in another dtype, a weight quantised since)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        grad = torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad)
        if x.dtype != torch.float32 or grad or not _plain(linear.weight):
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        return onednn_linear(x, linear.weight, linear.bias)
