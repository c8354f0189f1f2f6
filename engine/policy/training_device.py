"""Where a LoRA run trains: the CPU, a CUDA (or ROCm) GPU, or another accelerator. Pure.

Any accelerator clears the "no accelerator" gate (the earlier system's later
rule): a non-CUDA one (Apple MPS, Intel XPU) loads a 4-bit base through
bitsandbytes' multi-backend build, so a DiT run with ``base_precision`` nf4
or auto trains on it, while the dense modes' kernels stay CUDA-only. A
trainer that holds its base dense trains on the CPU there.
"""

from __future__ import annotations

from typing import Literal

from engine.hardware.profile import HardwareProfile
from engine.requests.choices import DEVICES  # noqa: F401 - re-exported: the devices a run may name

Device = Literal["auto", "cuda", "cpu"]
#: Accelerators other than CUDA / ROCm that a LoRA run may use: they clear the
#: "no accelerator" gate and load a 4-bit base (bitsandbytes' multi-backend),
#: while the dense modes (bf16 / int8 / fp8 / mxfp8 kernels) stay CUDA-only.
NON_CUDA_ACCELERATORS: tuple[str, ...] = ("mps", "xpu")


def training_device(hardware: HardwareProfile, requested: str = "auto", *, four_bit_base: bool = True) -> str:
    """Where a run trains: ``cpu`` when asked (or nothing else is here), else
    CUDA, else a non-CUDA accelerator (``mps``, ``xpu``) for a family whose
    base can be held in 4-bit (``four_bit_base``; a trainer that holds its
    base dense trains on the CPU there)."""
    if requested == "cpu":
        return "cpu"
    if hardware.cuda:
        return "cuda"
    return hardware.vendor if four_bit_base and hardware.vendor in NON_CUDA_ACCELERATORS else "cpu"
