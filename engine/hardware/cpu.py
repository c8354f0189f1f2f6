"""The host CPU as the probe reads it without torch: its cores and its matmul instruction set.

Both decide CPU compute: threads go one per physical core (:func:`physical_cores`), and
the dtype follows the widest matmul the CPU multiplies natively (:func:`matmul_isa`):
AMX or AVX512-BF16 multiply bf16 in hardware (bf16 GEMMs there ran 3.5x (Zen 5,
AVX512-BF16) and 6.6x (Sapphire Rapids, AMX) torch's fp32 ones), elsewhere torch
emulates bf16 several times slower than fp32.
"""

from __future__ import annotations

import os

CPU_TOPOLOGY = "/sys/devices/system/cpu"
CPU_INFO = "/proc/cpuinfo"

#: The matmul instruction sets the engine tells apart, best first: (``/proc/cpuinfo``
#: flag, label), the label being what a plan's reason names.
MATMUL_ISAS: tuple[tuple[str, str], ...] = (
    ("amx_bf16", "AMX-BF16"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
)
#: The labels whose CPUs multiply bf16 natively.
NATIVE_BF16_ISAS = frozenset({"AMX-BF16", "AVX512-BF16"})


def cpu_flags(path: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (Linux's ``/proc/cpuinfo``; empty where unreadable)."""
    try:
        with open(path or CPU_INFO, encoding="utf-8") as handle:
            line = next((line for line in handle if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def matmul_isa(flags: frozenset[str]) -> str:
    """The best matmul instruction set among ``flags`` (a :data:`MATMUL_ISAS` label; "" unknown)."""
    return next((label for flag, label in MATMUL_ISAS if flag in flags), "")


def cpu_model(path: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``), "" where unreadable: part of the GEMM cache's key."""
    try:
        with open(path or CPU_INFO, encoding="utf-8") as handle:
            line = next((line for line in handle if line.startswith("model name")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity, where the system reports it)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 0))


def physical_cores(root: str | None = None, cpus: set[int] | None = None) -> int | None:
    """Physical cores among ``cpus`` (default: :func:`usable_cpus`), read from each CPU's
    ``topology/thread_siblings_list``: SMT siblings share one core and its FPU, so they
    count once. None where a CPU's list cannot be read (not Linux, a container without /sys)."""
    cores: set[frozenset[int]] = set()
    for cpu in usable_cpus() if cpus is None else cpus:
        try:
            with open(os.path.join(root or CPU_TOPOLOGY, f"cpu{cpu}", "topology", "thread_siblings_list"), encoding="ascii") as handle:
                cores.add(frozenset(_cpu_list(handle.read())))
        except (OSError, ValueError):
            return None
    return len(cores) or None


def _cpu_list(text: str) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8} (the kernel's CPU list format)."""
    spans = (part.partition("-") for part in text.strip().split(","))
    return {cpu for low, _, high in spans for cpu in range(int(low), int(high or low) + 1)}
