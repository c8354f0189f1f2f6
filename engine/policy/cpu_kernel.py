"""CPU compute: the dtype and the GEMM kernel a CPU plan runs, from what the probe found.

Torch-free. A tiny generate spends two thirds of its time in ``addmm``, so the
kernel is the CPU plan's speed. A plan takes the fastest kernel the CPU has, the default
included: the model's own dtype where the CPU multiplies it natively (images equal stock
diffusers' in that dtype pixel for pixel, what a GPU user of the model runs). Only
``--speed off`` asked for (or ``--dtype fp32``) keeps the exact fp32 upcast, and its reason
says what bf16 would gain here:

- **bf16** where the CPU multiplies bf16 natively (AMX or AVX512-BF16 in its flags) and
  the measured bf16 GEMM beats the best fp32 one by :data:`BF16_MARGIN`: bf16 ran 3.5x
  MKL's fp32 on a Zen 5 (AVX512-BF16) and 5.6x on a Sapphire Rapids (AMX). The families'
  weights are bf16 (their published dtype), what they run on every GPU. Until this
  machine is measured the flags decide.
- **fp32** elsewhere (emulated bf16 is several times slower than fp32), through the faster
  of MKL and oneDNN as measured here (:mod:`engine.hardware.gemm`): on a Zen 5 MKL's sgemm
  ran at AVX2 speed, half of oneDNN's; on Intel parts the two tie and MKL stays.
"""

from __future__ import annotations

from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto

#: bf16 is chosen over fp32 only when its GEMM is at least this much faster.
BF16_MARGIN = 1.25
#: oneDNN replaces MKL for fp32 only when at least this much faster (a tie keeps torch's default).
ONEDNN_MARGIN = 1.15


def bf16_gain(hardware: HardwareProfile) -> str:
    """Why bf16 is the faster CPU dtype here ("" where it is not): the ISA and, once measured, the figures."""
    if not hardware.cpu_bf16_matmul:
        return ""
    isa, gemm = hardware.cpu_isa or "native bf16 matmul", hardware.cpu_gemm
    if gemm is None:
        return f"{isa}: native bf16 matmul (its GEMMs not measured yet)"
    kernel, fp32 = gemm.fp32_best
    if gemm.bf16 < BF16_MARGIN * fp32:
        return ""
    return (f"{isa}: bf16 GEMMs ran {gemm.bf16:.0f} GFLOP/s against fp32's {fp32:.0f} ({kernel}), "
            f"{gemm.bf16 / fp32:.1f}x, measured here on {gemm.threads} threads{gemm.when}")


def cpu_dtype(hardware: HardwareProfile, *, fp32_fits: bool, exact: bool) -> Resolved[str]:
    """``dtype=auto`` on a CPU (see the module docstring)."""
    gain = bf16_gain(hardware)
    if gain and not exact:
        return auto("bf16", f"CPU with {gain}: the model's own dtype, equal to stock diffusers' in bf16 "
                            "(--dtype fp32 for the exact upcast)")
    if not fp32_fits:
        return auto("bf16", "CPU: fp32 does not fit host memory, bf16 halves it")
    if gain:
        return auto("fp32", f"CPU, speed off asked: fp32 is exact (images equal stock diffusers' in fp32); "
                            f"the default computes in bf16 here ({gain})")
    return auto("fp32", f"CPU without native bf16 matmul ({hardware.cpu_isa or 'ISA unknown'}): "
                        "fp32 is exact and faster than emulated bf16")


def resolve_cpu_kernel(hardware: HardwareProfile, *, dtype: str, engine: str, tier: str) -> Resolved[str | None]:
    """Which library runs the plan's CPU GEMMs: ``mkl`` (torch's fp32 default) or ``onednn``."""
    if hardware.vendor != "cpu" or engine != "diffusers":
        return auto(None, "GEMMs run on the accelerator" if hardware.vendor != "cpu" else "sd.cpp runs its own kernels")
    isa, gemm = hardware.cpu_isa or "ISA unknown", hardware.cpu_gemm
    if dtype != "fp32":
        return auto("onednn", f"torch sends {dtype} GEMMs to oneDNN ({isa} kernels)")
    if gemm is None:
        return auto("mkl", "torch's fp32 default (this CPU's kernels not measured yet)")
    faster = gemm.fp32_onednn >= ONEDNN_MARGIN * gemm.fp32_mkl
    figures = f"oneDNN's fp32 GEMM ran {gemm.fp32_onednn:.0f} GFLOP/s, MKL's {gemm.fp32_mkl:.0f} here ({isa})"
    if faster and tier != "off":
        return auto("onednn", f"{figures}: {gemm.fp32_onednn / gemm.fp32_mkl:.1f}x")
    if faster:
        return auto("mkl", f"the off tier keeps torch's default kernel (exact); {figures}: --speed default takes it")
    return auto("mkl", f"{figures}: torch's default stays")
