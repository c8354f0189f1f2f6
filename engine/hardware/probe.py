"""Read the real machine into a :class:`HardwareProfile`.

Two depths, so ``diffusion-engine info`` stays torch-free where it can:

- the light probe asks ``nvidia-smi`` (or the OS) and looks up installed
  packages without importing them: a few milliseconds;
- ``verify=True`` imports torch, reads the device properties, and runs the
  exact torchao call the int8 path uses on a tiny layer, so a stub torchao
  (one whose ``quantize_`` is a silent no-op) is found out.

By default the probe verifies when an accelerator is present, since that is
where torchao and bf16 support decide what can run; a machine without one
needs neither answer to refuse a GPU-only request.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

from engine.hardware import gemm
from engine.hardware.cpu import cpu_flags, matmul_isa, physical_cores, usable_cpus
from engine.hardware.kernel_floors import installed_attention_floors, installed_versions
from engine.hardware.profile import HardwareProfile, native_bf16

MIB_IN_GB = 2**20 / 1e9


@dataclass(frozen=True)
class _Gpu:
    name: str
    capability: tuple[int, int] | None
    total_gb: float
    free_gb: float | None
    #: The GPU reports no memory of its own: it shares the host's (integrated).
    unified: bool = False


#: Datacenter parts, and pro cards built like them (full-rate fp32
#: accumulation): int8 is not moved first and fp16 accumulation gains nothing.
#: Professional Blackwell (RTX PRO 6000, Workstation, Max-Q and Server
#: Editions) is datacenter-class and prefers fp8, as the earlier system found.
_DATACENTER = re.compile(
    r"\b(A100|A800|H100|H800|H200|GH200|B100|B200|GB200|B300|GB300|L40S?|L20|L4|A40|A30|A16|A10G?|A2|"
    r"T4|V100|P100|P40|Tesla|RTX 6000 Ada|RTX PRO 6000)\b",
    re.IGNORECASE,
)
#: Workstation cards: consumer-class tensor cores under a pro name.
_WORKSTATION = re.compile(r"\b(RTX A\d{4}|Quadro|RTX PRO|RTX \d{4} Ada)\b", re.IGNORECASE)


def gpu_class(name: str) -> str:
    """``consumer``, ``workstation`` or ``datacenter`` for an NVIDIA device name.

    Datacenter parts are recognised by name; pro cards (RTX A4000/A5000,
    Quadro, RTX PRO) are workstation; everything else, unknown names
    included, is taken for a consumer card: those are the many, and a new
    datacenter part is added here when it ships.
    """
    if _DATACENTER.search(name):
        return "datacenter"
    if _WORKSTATION.search(name):
        return "workstation"
    return "consumer"


def consumer_class(name: str) -> bool:
    """Consumer and workstation cards share the policy (int8 first, fp16 accumulation)."""
    return gpu_class(name) != "datacenter"


def probe(*, verify: bool | None = None) -> HardwareProfile:
    """This machine's profile; ``verify`` as described in the module docstring."""
    light = _light_probe()
    if verify is None:
        verify = light.vendor in ("nvidia", "rocm")
    return _verify_with_torch(light) if verify else light


ATTENTION_PACKAGES = ("flash_attn", "kernels", "sageattention", "xformers")


def installed_attention_packages() -> tuple[str, ...]:
    return tuple(p for p in ATTENTION_PACKAGES if importlib.util.find_spec(p) is not None)


def _torch_exposes_fp16_accumulation() -> bool:
    """torch 2.7+ has the flag; read the version without importing torch."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(p) for p in re.findall(r"\d+", version)[:2])
    return (major, minor) >= (2, 7)


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_exposes_fp8_floor() -> bool:
    """Whether the installed torchao's float8 config takes ``activation_value_lb``.

    Read from torchao's source without importing it (importing pulls torch).
    """
    spec = importlib.util.find_spec("torchao")
    if spec is None or not spec.submodule_search_locations:
        return False
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "quantization", "quant_api.py")
        try:
            with open(path, encoding="utf-8") as handle:
                if "activation_value_lb" in handle.read():
                    return True
        except OSError:
            continue
    return False


def _light_probe() -> HardwareProfile:
    profile = _light_probe_device()
    return profile.replace(
        attention_packages=installed_attention_packages(),
        attention_versions=installed_versions(installed_attention_packages()),
        attention_floors=installed_attention_floors(),
        torch_fp16_accumulation=_torch_exposes_fp16_accumulation(),
        torch_version=_torch_version(),
        fp8_activation_floor=torchao_exposes_fp8_floor(),
        swap_free_gb=_swap_free_gb(),
        sdcpp_installed=importlib.util.find_spec("stable_diffusion_cpp") is not None,
        **_cpu_matmul(profile.physical_cores),
    )


def _cpu_matmul(cores: int | None) -> dict[str, object]:
    """The CPU's matmul ISA and its GEMM figures as cached for ``cores`` threads (measured: ``verify=True``)."""
    isa = matmul_isa(cpu_flags())
    return {"cpu_isa": isa, "cpu_bf16_matmul": gemm.native_bf16(isa), "cpu_gemm": gemm.cached(isa, cores)}


def _light_probe_device() -> HardwareProfile:
    cpu_count, cores = len(usable_cpus()) or None, physical_cores()  # sd.cpp threads them on any machine
    torchao_installed = importlib.util.find_spec("torchao") is not None
    bnb_installed = importlib.util.find_spec("bitsandbytes") is not None
    gpu = _nvidia_smi()
    if gpu is not None:
        total_gb, free_gb = (gpu.total_gb, gpu.free_gb) if not gpu.unified else _host_memory_gb()
        return HardwareProfile(
            name="this-machine",
            vendor="nvidia",
            device_name=gpu.name,
            total_memory_gb=total_gb,
            free_memory_gb=free_gb,
            capability=gpu.capability,
            unified_memory=gpu.unified,
            consumer=consumer_class(gpu.name),
            gpu_class=gpu_class(gpu.name),
            native_bf16=native_bf16("nvidia", gpu.capability, False),
            torchao_functional=torchao_installed,
            bitsandbytes_usable=bnb_installed,
            cpu_count=cpu_count,
            physical_cores=cores,
            source="probe",
        )
    if shutil.which("rocm-smi") or os.path.exists("/dev/kfd"):
        # ROCm details (memory, bf16) come from torch; the light probe only
        # knows the vendor, so it says nothing it cannot back.
        return HardwareProfile(
            name="this-machine",
            vendor="rocm",
            device_name="AMD GPU",
            total_memory_gb=0.0,
            free_memory_gb=None,
            torchao_functional=torchao_installed,
            bitsandbytes_usable=False,
            cpu_count=cpu_count,
            physical_cores=cores,
            source="probe",
        )
    total, free = _host_memory_gb()
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return HardwareProfile(
            name="this-machine",
            vendor="mps",
            device_name="Apple Silicon",
            total_memory_gb=total,
            free_memory_gb=free,
            unified_memory=True,
            native_bf16=True,
            torchao_functional=torchao_installed,
            bitsandbytes_usable=bnb_installed,
            cpu_count=cpu_count,
            physical_cores=cores,
            source="probe",
        )
    return HardwareProfile(
        name="this-machine",
        vendor="cpu",
        device_name=platform.processor() or platform.machine() or "CPU",
        total_memory_gb=total,
        free_memory_gb=free,
        native_bf16=True,
        torchao_functional=torchao_installed,
        bitsandbytes_usable=False,
        cpu_count=cpu_count,
        physical_cores=cores,
        source="probe",
    )


#: One GPU as ``nvidia-smi`` reports it: name, compute capability, total and free GB
#: (None for both on integrated GPUs, which report "[N/A]": they use host memory).
SmiRow = tuple[str, "tuple[int, int] | None", "float | None", "float | None"]


def nvidia_smi_rows() -> list[SmiRow]:
    """The GPUs torch will see, in its device order: those ``nvidia-smi`` lists,
    narrowed and ordered by ``CUDA_VISIBLE_DEVICES`` (numeric indices) as CUDA
    does; [] without nvidia-smi, on output it cannot read, or for a visible list
    it cannot map (UUIDs: the caller falls back to torch).

    One subprocess call: no CUDA context is created on any card.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows: list[SmiRow] = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            return []
        name, cap, total, free = parts
        try:
            major, minor = (int(x) for x in cap.split("."))
            capability: tuple[int, int] | None = (major, minor)
        except ValueError:
            capability = None
        try:
            rows.append((name, capability, float(total) * MIB_IN_GB, float(free) * MIB_IN_GB))
        except ValueError:
            rows.append((name, capability, None, None))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return rows
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in wanted):
        return []
    return [rows[int(v)] for v in wanted if int(v) < len(rows)]


def _nvidia_smi() -> _Gpu | None:
    rows = nvidia_smi_rows()
    if not rows:
        return None
    name, capability, total, free = rows[0]
    if total is None:
        return _Gpu(name, capability, 0.0, None, unified=True)
    return _Gpu(name, capability, total, free)


def _swap_free_gb() -> float | None:
    """Free swap in GB (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return int(fields["SwapFree"].split()[0]) * 1024 / 1e9
    except (OSError, KeyError, ValueError):
        return None


def _host_memory_gb() -> tuple[float, float | None]:
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024 / 1e9
        free = int(fields["MemAvailable"].split()[0]) * 1024 / 1e9
        return total, free
    except (OSError, KeyError, ValueError):
        pass
    try:
        total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total_bytes / 1e9, None
    except (ValueError, OSError, AttributeError):
        return 0.0, None


def _verify_with_torch(light: HardwareProfile) -> HardwareProfile:
    import torch

    changes: dict[str, object] = {"source": "probe+torch"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        vendor = "rocm" if getattr(torch.version, "hip", None) else "nvidia"
        capability = (props.major, props.minor) if vendor == "nvidia" else None
        integrated = bool(getattr(props, "is_integrated", False))
        changes.update(
            vendor=vendor,
            device_name=props.name,
            total_memory_gb=total / 1e9,
            free_memory_gb=free / 1e9,
            capability=capability,
            unified_memory=light.unified_memory or integrated,
            native_bf16=native_bf16(vendor, capability, torch.cuda.is_bf16_supported()),
            bitsandbytes_usable=light.bitsandbytes_usable and bitsandbytes_usable(),
        )
    else:
        changes.update(bitsandbytes_usable=False)
        if light.vendor in ("nvidia", "rocm"):
            # A driver is there but this torch build cannot use it.
            total, free = _host_memory_gb()
            changes.update(vendor="cpu", total_memory_gb=total, free_memory_gb=free)
    changes["torchao_functional"] = light.torchao_functional and torchao_functional()
    if changes.get("vendor", light.vendor) == "cpu":  # CPU compute: its kernels timed once per machine
        changes["cpu_gemm"] = gemm.measured(light.cpu_isa, light.physical_cores)
    device = changes.get("device_name")
    if device and changes.get("vendor") == "nvidia":
        changes.update(consumer=consumer_class(str(device)), gpu_class=gpu_class(str(device)))
    return light.replace(**changes)


@functools.cache
def torchao_functional() -> bool:
    """True when the symbols the int8 path uses import *and* quantise.

    Some platform builds ship a torchao stub: ``find_spec`` succeeds and even
    ``from torchao.quantization import quantize_`` imports, but ``quantize_``
    leaves the layer dense. The only honest check is to run it on a tiny
    layer and see the weight become a quantised tensor.
    """
    try:
        import torch
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return False
    layer = torch.nn.Linear(32, 32, bias=False, dtype=torch.bfloat16)
    try:
        quantize_(layer, Int8WeightOnlyConfig())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return type(layer.weight) not in (torch.Tensor, torch.nn.Parameter)


@functools.cache
def bitsandbytes_usable() -> bool:
    """bitsandbytes imports and has a CUDA backend (4-bit loads need one)."""
    try:
        import bitsandbytes  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
