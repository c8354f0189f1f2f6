"""Well-known machines, so any decision can be asked for a machine you lack.

Memory is the usable device memory in decimal GB (what ``nvidia-smi`` reports,
converted), free memory assumes an idle card less the CUDA context. Library
availability assumes a normal Linux install (torchao works; bitsandbytes on
CUDA). Override any field with ``HardwareProfile.replace`` or the CLI flags.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from engine.errors import UnknownName
from engine.hardware.devices import with_devices
from engine.hardware.kernel_floors import installed_attention_floors
from engine.hardware.probe import gpu_class
from engine.hardware.profile import HardwareProfile, Vendor, native_bf16


def _gpu(
    name: str,
    device_name: str,
    total_gb: float,
    capability: tuple[int, int] | None,
    *,
    vendor: Vendor = "nvidia",
    unified: bool = False,
    torch_reports_bf16: bool = True,
    cpu_count: int | None = None,
) -> HardwareProfile:
    cuda = vendor in ("nvidia", "rocm")
    klass = gpu_class(device_name) if vendor == "nvidia" else ""
    return HardwareProfile(
        # Software, not hardware: the floors of this machine's diffusers, so a plan for a
        # card you do not have installs what your diffusers would accept.
        attention_floors=installed_attention_floors(),
        name=name,
        vendor=vendor,
        device_name=device_name,
        total_memory_gb=total_gb,
        # An idle card: everything but the ~0.5 GB a CUDA context takes.
        free_memory_gb=round(total_gb - 0.5, 1) if cuda and not unified else round(total_gb * 0.75, 1),
        capability=capability,
        unified_memory=unified,
        # Consumer and workstation cards: int8 first, fp16 accumulation gains.
        consumer=klass in ("consumer", "workstation"),
        gpu_class=klass,
        native_bf16=native_bf16(vendor, capability, torch_reports_bf16),
        torchao_functional=True,
        # bitsandbytes' 4-bit load: CUDA, and the multi-backend build on Apple / Intel GPUs.
        bitsandbytes_usable=cuda or vendor in ("mps", "xpu"),
        cpu_count=cpu_count,
        source="preset",
    )


_PRESETS: tuple[HardwareProfile, ...] = (
    _gpu("cpu", "x86-64 CPU", 32.0, None, vendor="cpu", cpu_count=8),
    _gpu("t4", "Tesla T4", 15.8, (7, 5)),
    _gpu("v100", "Tesla V100-SXM2-32GB", 34.1, (7, 0)),
    _gpu("rtx2080ti", "GeForce RTX 2080 Ti", 11.8, (7, 5)),
    _gpu("rtx3090", "GeForce RTX 3090", 25.4, (8, 6)),
    _gpu("rtx4090", "GeForce RTX 4090", 25.3, (8, 9)),
    _gpu("rtx5090", "GeForce RTX 5090", 33.7, (12, 0)),
    _gpu("rtx-a4000", "NVIDIA RTX A4000", 17.2, (8, 6)),
    _gpu("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation", 51.5, (8, 9)),
    _gpu("a100-40g", "A100-SXM4-40GB", 42.4, (8, 0)),
    _gpu("a100-80g", "A100-SXM4-80GB", 85.1, (8, 0)),
    _gpu("l40s", "L40S", 48.3, (8, 9)),
    _gpu("h100", "H100 80GB HBM3", 85.0, (9, 0)),
    _gpu("h200", "H200", 150.0, (9, 0)),
    _gpu("b200", "B200", 191.5, (10, 0)),
    _gpu("mi300x", "AMD Instinct MI300X", 205.8, None, vendor="rocm"),
    _gpu("apple-m3-max", "Apple M3 Max", 128.0, None, vendor="mps", unified=True),
    # An integrated NVIDIA GPU sharing 128 GB with the host (GB10).
    _gpu("dgx-spark", "NVIDIA GB10", 128.5, (12, 1), unified=True),
)

PRESETS: Mapping[str, HardwareProfile] = MappingProxyType({p.name: p for p in _PRESETS})


def preset(name: str) -> HardwareProfile:
    """The preset called ``name``; :class:`UnknownName` lists the valid ones.

    ``NxNAME`` (``4xh100``) is a machine with N such devices: multi-GPU
    training plans can be asked for a box you do not have.
    """
    count, _, single = name.lower().partition("x")
    if count.isdigit() and single in PRESETS and PRESETS[single].cuda and 1 <= int(count) <= 64:
        return with_devices(PRESETS[single], int(count)).replace(name=name.lower())
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownName("preset", name, PRESETS) from None
