"""The CPU's GEMM speed per kernel, measured once per machine and cached.

Which CPU kernel is fastest is a fact of the machine, not of its flags: MKL's fp32
sgemm ran at AVX2 speed on a Zen 5 (72-82 GFLOP/s per core) where oneDNN's ran at
161-168, and on a Sapphire Rapids the two tied (170 per core) while AMX's bf16 ran
6.6x faster. So a CPU plan does not guess: :func:`measured` times one 3072-wide
product (256 tokens x 3072 x 3072) through ``nn.Linear``'s fp32 (MKL), oneDNN's fp32
and torch's bf16, about a second once, and caches the figures in the engine's data
folder, keyed by the CPU's model, its matmul ISA, torch's version and the thread
count. The light probe reads the cache without importing torch (:func:`cached`); the
verified probe measures where nothing is cached.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any

from engine import stored
from engine.hardware.cpu import NATIVE_BF16_ISAS, cpu_model, physical_cores, usable_cpus
from engine.hardware.profile import CpuGemm
from engine.places import data_home

ENV_FILE = "DIFFUSION_ENGINE_CPU_GEMM"
#: The measured product: a 12B transformer's width, a 256-token slice.
SHAPE = (256, 3072, 3072)
#: Each kernel is timed for about this long (best of its runs), after one warm-up call.
SECONDS_PER_KERNEL = 0.25


def native_bf16(isa: str) -> bool:
    """Whether the matmul ISA multiplies bf16 in hardware (AMX, AVX512-BF16)."""
    return isa in NATIVE_BF16_ISAS


def cache_file() -> Path:
    """``$DIFFUSION_ENGINE_CPU_GEMM``, else ``cpu-gemm.json`` in the engine's data folder."""
    explicit = os.environ.get(ENV_FILE)
    return Path(explicit) if explicit else data_home() / "cpu-gemm.json"


def default_threads() -> int:
    """The threads a CPU plan runs by default: one per physical core."""
    return physical_cores() or max(1, len(usable_cpus()) // 2)


def cache_key(isa: str, threads: int) -> str:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    return f"{cpu_model() or 'cpu'} | {isa or 'isa unknown'} | torch {torch_version} | {threads} threads"


def cached(isa: str, threads: int | None = None) -> CpuGemm | None:
    """The cached figures for this machine (no torch import), or None."""
    entry = _read().get(cache_key(isa, threads or default_threads()))
    try:
        return CpuGemm(**{k: entry[k] for k in ("fp32_mkl", "fp32_onednn", "bf16", "threads")}) if entry else None
    except (KeyError, TypeError):
        return None


def measured(isa: str, threads: int | None = None) -> CpuGemm:
    """The cached figures, else measured now (and cached)."""
    threads = threads or default_threads()
    known = cached(isa, threads)
    if known is not None:
        return known
    figures = measure(threads)
    entries = _read()
    entries[cache_key(isa, threads)] = {**figures.__dict__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass  # a read-only cache: measured again next time, still right
    return figures


def measure(threads: int) -> CpuGemm:
    """Time :data:`SHAPE` through each kernel on ``threads`` threads (torch's count restored)."""
    import torch

    tokens, width, out = SHAPE
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            x, weight = torch.randn(tokens, width), torch.randn(out, width) / width**0.5
            xb, wb = x.bfloat16(), weight.bfloat16()
            fp32_mkl = _gflops(lambda: torch.nn.functional.linear(x, weight))
            fp32_onednn = _gflops(lambda: onednn_linear(x, weight, None)) if onednn_available() else 0.0
            bf16 = _gflops(lambda: torch.nn.functional.linear(xb, wb))
    finally:
        torch.set_num_threads(before)
    return CpuGemm(round(fp32_mkl, 1), round(fp32_onednn, 1), round(bf16, 1), threads)


def onednn_available() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: Any, weight: Any, bias: Any) -> Any:
    """``F.linear`` through oneDNN's fp32 kernel (the op torch's inductor uses for CPU linears):
    same inputs and result layout, the weight used as it is (no packed copy held)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _gflops(call: Any) -> float:
    tokens, width, out = SHAPE
    call()
    best, spent = float("inf"), 0.0
    while spent < SECONDS_PER_KERNEL:  # at least one timed run: spent starts at 0
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * tokens * width * out / best / 1e9


def _read() -> dict[str, Any]:
    try:
        data = stored.read_json(cache_file())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
