"""What the engine knows about a machine, as plain data.

A :class:`HardwareProfile` is read from the real machine by
:func:`engine.hardware.probe.probe` or taken from a preset, so every decision
can be asked for a machine you do not have (``--hardware t4``). Capability
rules (native bf16, fp8, mxfp8) are derived here from vendor and compute
capability, never from ``torch.cuda.is_bf16_supported()`` on NVIDIA: it
reports emulated bf16 on Turing and Volta as supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Vendor = Literal["nvidia", "rocm", "mps", "cpu"]

GIB_IN_GB = 2**30 / 1e9

#: First NVIDIA architecture with native bf16 tensor cores (Ampere).
NATIVE_BF16_MIN_CAPABILITY = (8, 0)
#: fp8 tensor-core GEMMs: Ada, Hopper and newer.
FP8_MIN_CAPABILITY = (8, 9)
#: mxfp8 / nvfp4 block-scaled GEMMs: Blackwell (sm100) and newer.
MX_MIN_CAPABILITY = (10, 0)


def native_bf16(vendor: Vendor, capability: tuple[int, int] | None, torch_reports_bf16: bool) -> bool:
    """Whether bf16 runs natively: NVIDIA by capability, ROCm and MPS as torch says.

    NVIDIA: compute capability major >= 8. ``torch.cuda.is_bf16_supported()``
    counts emulation there, so it is ignored. ROCm's answer is trustworthy.
    CPU runs bf16 (slowly) everywhere torch does.
    """
    if vendor == "nvidia":
        return capability is not None and capability >= NATIVE_BF16_MIN_CAPABILITY
    if vendor == "cpu":
        return True
    return torch_reports_bf16


@dataclass(frozen=True)
class DeviceFacts:
    """One accelerator of a machine with several (``devices`` of a profile)."""

    name: str
    total_memory_gb: float
    free_memory_gb: float | None
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class CpuGemm:
    """GFLOP/s of one 3072-wide GEMM through each CPU kernel torch has, on ``threads`` threads.

    ``fp32_mkl`` is ``nn.Linear``'s default (MKL's sgemm), ``fp32_onednn`` the same product
    through oneDNN, ``bf16`` torch's bf16 GEMM (oneDNN: AMX or AVX512-BF16 where the CPU has
    them, emulated elsewhere). Which is fastest differs by CPU: on a Zen 5 MKL ran at AVX2
    speed (72-82 per core) where oneDNN ran 161-168; on a Sapphire Rapids both ran 170.
    """

    fp32_mkl: float
    fp32_onednn: float
    bf16: float
    threads: int
    #: When they were measured (``YYYY-MM-DD``) and the machine's 1-minute load then.
    measured_on: str = ""
    load: float | None = None

    @property
    def when(self) -> str:
        """How a plan quotes the figures' age and load (``measured here on 2 threads, 2026-12-07, load 1.2``)."""
        return "".join([f", {self.measured_on}" if self.measured_on else "",
                        f", load {self.load:.1f}" if self.load is not None else ""])

    @property
    def fp32_best(self) -> tuple[str, float]:
        """The faster fp32 kernel and its speed."""
        return ("onednn", self.fp32_onednn) if self.fp32_onednn > self.fp32_mkl else ("mkl", self.fp32_mkl)


@dataclass(frozen=True)
class HardwareProfile:
    """One machine's accelerator and the libraries usable on it.

    Memory is in decimal GB. ``free_memory_gb`` is what the accelerator has
    free now (the host's free RAM for ``cpu``), None when unknown.
    """

    name: str
    vendor: Vendor
    device_name: str
    total_memory_gb: float
    free_memory_gb: float | None
    capability: tuple[int, int] | None = None
    unified_memory: bool = False
    consumer: bool = False
    native_bf16: bool = False
    torchao_functional: bool = True
    bitsandbytes_usable: bool = False
    cpu_count: int | None = None
    #: Physical cores among the CPUs this process may use (Linux's thread-sibling lists: SMT
    #: siblings count once); None where the topology is unreadable (presets, other systems).
    physical_cores: int | None = None
    #: Optional attention kernels installed (import names: ``flash_attn``,
    #: ``kernels`` (loads the FA3 hub kernel), ``sageattention``, ``xformers``).
    attention_packages: tuple[str, ...] = ()
    #: The installed attention packages' versions, as (import name, version) pairs.
    attention_versions: tuple[tuple[str, str], ...] = ()
    #: The version each optional kernel needs before diffusers' dispatcher takes it, as
    #: (backend, version) pairs read from the installed diffusers
    #: (:mod:`engine.hardware.kernel_floors`); presets carry this machine's too.
    attention_floors: tuple[tuple[str, str], ...] = ()
    #: torch exposes ``torch.backends.cuda.matmul.allow_fp16_accumulation`` (2.7+).
    torch_fp16_accumulation: bool = True
    #: The installed torch's version (``2.8.0+cu128``), None when unknown
    #: (presets): picks the xformers wheel built against it.
    torch_version: str | None = None
    #: torchao's float8 config takes ``activation_value_lb``, the floor on
    #: fp8 activation scales that keeps all-zero rows finite.
    fp8_activation_floor: bool = True
    #: The stable-diffusion.cpp binding (the CPU engine) is installed.
    sdcpp_installed: bool = False
    #: The host CPU multiplies bf16 natively (AMX or AVX512-BF16): torch's bf16 GEMMs run
    #: at full speed there, and are emulated (several times slower) elsewhere.
    cpu_bf16_matmul: bool = False
    #: The CPU's best matmul instruction set ("AMX-BF16", "AVX512-BF16", "AVX-512", "AVX2";
    #: "" unknown): what a CPU plan's dtype reason names (:mod:`engine.hardware.cpu`).
    cpu_isa: str = ""
    #: The CPU's GEMM speeds per kernel, measured once per machine and cached
    #: (:mod:`engine.hardware.gemm`); None until measured.
    cpu_gemm: CpuGemm | None = None
    #: Free swap, GB: host memory a CPU run may spill into (slowly).
    swap_free_gb: float | None = None
    #: "consumer", "workstation" or "datacenter", by the device name.
    gpu_class: str = ""
    #: Where the facts came from: "preset", "probe" or "probe+torch".
    source: str = "preset"
    #: Every accelerator, in device-index order, when the machine has several
    #: (the fields above describe device 0); empty: one device, or none.
    #: Multi-GPU training checks each (see :mod:`engine.hardware.devices`).
    devices: tuple[DeviceFacts, ...] = ()

    @property
    def cuda(self) -> bool:
        """A CUDA device in torch's sense (NVIDIA, or ROCm through HIP)."""
        return self.vendor in ("nvidia", "rocm")

    @property
    def fp8(self) -> bool:
        return self.vendor == "nvidia" and self._capability_at_least(FP8_MIN_CAPABILITY)

    @property
    def mxfp8(self) -> bool:
        return self.vendor == "nvidia" and self._capability_at_least(MX_MIN_CAPABILITY)

    @property
    def nvfp4(self) -> bool:
        return self.mxfp8

    @property
    def capability_label(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}" if self.capability else "-"

    def _capability_at_least(self, minimum: tuple[int, int]) -> bool:
        return self.capability is not None and self.capability >= minimum

    def replace(self, **changes: object) -> HardwareProfile:
        """A copy with ``changes`` (CLI overrides such as ``--free-gb``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data.update(cuda=self.cuda, fp8=self.fp8, mxfp8=self.mxfp8, nvfp4=self.nvfp4)
        return data
