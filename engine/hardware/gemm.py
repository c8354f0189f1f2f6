"""The CPU's GEMM speed per kernel, measured per machine, cached, and re-measured when stale.

Which CPU kernel is fastest is a fact of the machine, not of its flags: MKL's fp32
sgemm ran at AVX2 speed on a Zen 5 (72-82 GFLOP/s per core) where oneDNN's ran at
161-168, and on a Sapphire Rapids the two tied (170 per core) while AMX's bf16 ran
6.6x faster. So a CPU plan does not guess: :func:`measured` times one 3072-wide
product (256 tokens x 3072 x 3072) through ``nn.Linear``'s fp32 (MKL), oneDNN's fp32
and torch's bf16, about a second once, and caches the figures in the engine's data
folder, keyed by the CPU's model, its matmul ISA, torch's version and the thread
count. The light probe reads the cache without importing torch (:func:`cached`); the
verified probe measures where nothing is cached.

A busy machine measures slow in wall time (at a load of 7-15 on 2 cores the wall-clock figures
read 7-11x below the same kernels' CPU time). So each kernel is timed in short runs spaced
apart, each by the wall clock and by the process's CPU time per thread, the best of either
kept (a descheduled thread costs wall time, not CPU time); the 1-minute load and the date are
stored beside the figures and quoted with them. Figures older than :data:`STALE_DAYS`, or
taken at a load above the cores and older than an hour, are measured again.
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
#: Each kernel is timed for about this long (best of its runs), after one warm-up call, in
#: :data:`ROUNDS` rounds spaced :data:`PAUSE` seconds apart.
SECONDS_PER_KERNEL = 0.25
ROUNDS, PAUSE = 3, 0.05
#: Figures older than this are measured again; so are those taken under a load above the
#: machine's cores, once an hour has passed.
STALE_DAYS, BUSY_RETRY_SECONDS = 30, 3600.0


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
    if not isinstance(entry, dict) or _stale(entry):
        return None
    try:
        figures = {k: entry[k] for k in ("fp32_mkl", "fp32_onednn", "bf16", "threads")}
        load = entry.get("load")
        return CpuGemm(**figures, measured_on=str(entry.get("measured_at", ""))[:10],
                       load=float(load) if isinstance(load, (int, float)) else None)
    except (KeyError, TypeError, ValueError):
        return None


def _stale(entry: dict[str, Any], now: float | None = None) -> bool:
    """Whether ``entry`` should be measured again: older than :data:`STALE_DAYS`, or taken under
    a load above the cores more than :data:`BUSY_RETRY_SECONDS` ago (an entry without its
    time, from an earlier version, is measured again)."""
    taken = entry.get("measured_epoch")
    if not isinstance(taken, (int, float)):
        return True
    age = (time.time() if now is None else now) - taken
    load = entry.get("load")
    busy = isinstance(load, (int, float)) and load > (physical_cores() or len(usable_cpus()))
    return age > STALE_DAYS * 86400 or (busy and age > BUSY_RETRY_SECONDS)


def measured(isa: str, threads: int | None = None) -> CpuGemm:
    """The cached figures, else measured now (and cached)."""
    threads = threads or default_threads()
    known = cached(isa, threads)
    if known is not None:
        return known
    figures = measure(threads)
    entries = _read()
    entries[cache_key(isa, threads)] = {
        "fp32_mkl": figures.fp32_mkl, "fp32_onednn": figures.fp32_onednn, "bf16": figures.bf16,
        "threads": figures.threads, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "measured_epoch": time.time(), "load": figures.load,
    }
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
            fp32_mkl = _gflops(lambda: torch.nn.functional.linear(x, weight), threads)
            fp32_onednn = _gflops(lambda: onednn_linear(x, weight, None), threads) if onednn_available() else 0.0
            bf16 = _gflops(lambda: torch.nn.functional.linear(xb, wb), threads)
    finally:
        torch.set_num_threads(before)
    return CpuGemm(round(fp32_mkl, 1), round(fp32_onednn, 1), round(bf16, 1), threads,
                   measured_on=time.strftime("%Y-%m-%d"), load=_load())


def onednn_available() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: Any, weight: Any, bias: Any) -> Any:
    """``F.linear`` through oneDNN's fp32 kernel (the op torch's inductor uses for CPU linears):
    same inputs and result layout, the weight used as it is (no packed copy held)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _gflops(call: Any, threads: int) -> float:
    """GFLOP/s of ``call``: its fastest run by the wall clock or by CPU time per thread, over
    :data:`ROUNDS` rounds spaced apart (a busy moment spoils a round, not the figure)."""
    tokens, width, out = SHAPE
    call()
    best = float("inf")
    for round_ in range(ROUNDS):
        if round_:
            time.sleep(PAUSE)
        spent = 0.0
        while spent < SECONDS_PER_KERNEL / ROUNDS:  # at least one timed run: spent starts at 0
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best, spent = min(best, wall, cpu / threads if cpu > 0 else wall), spent + wall
    return 2 * tokens * width * out / best / 1e9


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _read() -> dict[str, Any]:
    try:
        data = stored.read_json(cache_file())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
