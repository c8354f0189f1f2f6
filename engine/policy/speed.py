"""Speed controls: attention kernel, step cache, compile, fp16 accumulation, threads.

Each resolver takes the speed tier (off | eager | default | max) and the
family's optimisation deny list, and returns a :class:`Resolved` whose reason
names the rule that fired.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit

SPEED_TIERS: tuple[str, ...] = ("off", "eager", "default", "max")
STEP_CACHES: tuple[str, ...] = ("auto", "off", "fbcache")
COMPILE_REQUESTS: tuple[str, ...] = ("auto", "on", "off")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "native", "flash", "flash3", "sage", "xformers")

FP16_ACCUM_KILL_SWITCH = "DIFFUSION_ENGINE_DISABLE_FP16_ACCUM"
ATTENTION_INSTALL_ENV = "DIFFUSION_ENGINE_ATTENTION_INSTALL"


@dataclass(frozen=True)
class StepCacheThresholds:
    """First-Block-Cache: engage at this many steps, with these residual thresholds."""

    min_steps: int = 20
    threshold: float = 0.08
    quantised_threshold: float = 0.12


@dataclass(frozen=True)
class AttentionBackend:
    """An optional kernel: the package it needs and the cards it runs on."""

    package: str
    pip_name: str
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None = None


#: Backends beyond torch's SDPA (``native``), by our name.
OPTIONAL_BACKENDS: Mapping[str, AttentionBackend] = {
    "flash": AttentionBackend("flash_attn", "flash-attn", (8, 0)),
    "flash3": AttentionBackend("flash_attn_interface", "kernels", (9, 0), (9, 0)),
    "sage": AttentionBackend("sageattention", "sageattention", (8, 0)),
    "xformers": AttentionBackend("xformers", "xformers", (7, 0)),
}


def resolve_speed_tier(requested: str) -> Resolved[str]:
    if requested not in SPEED_TIERS:
        raise ValueError(f"speed tier {requested!r} is not one of {', '.join(SPEED_TIERS)}")
    if requested == "default":
        return auto("default", "default tier: compile on CUDA, auto step cache, safe fp16 accumulation")
    return explicit(requested)


def attention_arch_error(name: str, hardware: HardwareProfile) -> str | None:
    """Why this card cannot run backend ``name`` (the arch gate), or None."""
    backend = OPTIONAL_BACKENDS[name]
    if hardware.vendor != "nvidia" or hardware.capability is None:
        return f"{name} attention needs an NVIDIA GPU; this is {hardware.device_name}"
    if hardware.capability < backend.min_capability:
        return f"{name} attention needs sm{backend.min_capability[0]}{backend.min_capability[1]}+; this is {hardware.capability_label}"
    if backend.max_capability and hardware.capability > backend.max_capability:
        return f"{name} attention runs on Hopper (sm90) only; this is {hardware.capability_label}"
    return None


def resolve_attention(
    requested: str,
    hardware: HardwareProfile,
    denied: Mapping[str, str],
    env: Mapping[str, str],
) -> tuple[Resolved[str], str | None]:
    """(backend, pip package to try installing at load or None).

    An explicit request that the card cannot run (or the family denies)
    falls back to native SDPA with the reason. A missing package is
    installed best-effort at load, only for an explicit request, only after
    the arch gate, and only while ``DIFFUSION_ENGINE_ATTENTION_INSTALL`` is
    not ``0``.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention {requested!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if requested == "native":
        return explicit("native"), None
    if requested == "auto":
        if (
            "flash_attn_interface" in hardware.attention_packages
            and "flash3" not in denied
            and attention_arch_error("flash3", hardware) is None
        ):
            return auto("flash3", "FlashAttention-3 is installed and this is a Hopper GPU"), None
        return auto("native", "torch SDPA (it picks the flash / memory-efficient kernel itself)"), None
    if requested in denied:
        return explicit("native", f"{requested} is denied for this family: {denied[requested]}; native SDPA"), None
    arch = attention_arch_error(requested, hardware)
    if arch:
        return explicit("native", f"{arch}; native SDPA"), None
    backend = OPTIONAL_BACKENDS[requested]
    if backend.package in hardware.attention_packages:
        return explicit(requested), None
    if env.get(ATTENTION_INSTALL_ENV, "auto") == "0":
        return explicit(
            "native", f"{backend.package} is not installed and {ATTENTION_INSTALL_ENV}=0; native SDPA"
        ), None
    return explicit(
        requested,
        f"{backend.package} is not installed: a wheel-only install of {backend.pip_name} is "
        "tried at load; native SDPA if it fails",
    ), backend.pip_name


def resolve_step_cache(
    requested: str,
    steps: int,
    *,
    quantised: bool,
    tier: str,
    denied: Mapping[str, str],
    thresholds: StepCacheThresholds = StepCacheThresholds(),
) -> tuple[Resolved[str], float]:
    """(``fbcache`` or ``off``, residual threshold). Re-asked at every generate."""
    if requested not in STEP_CACHES:
        raise ValueError(f"step cache {requested!r} is not one of {', '.join(STEP_CACHES)}")
    threshold = thresholds.quantised_threshold if quantised else thresholds.threshold
    if "step_cache" in denied:
        source = auto if requested == "auto" else explicit
        return source("off", f"step cache unavailable: {denied['step_cache']}"), threshold
    if requested == "off":
        return explicit("off", "pinned off"), threshold
    if requested == "fbcache":
        return explicit("fbcache", f"pinned on (residual threshold {threshold})"), threshold
    if tier == "off":
        return auto("off", "speed tier off"), threshold
    if steps >= thresholds.min_steps:
        return auto(
            "fbcache",
            f"{steps} steps >= {thresholds.min_steps}: First-Block-Cache "
            f"(residual threshold {threshold}{', quantised transformer' if quantised else ''})",
        ), threshold
    return auto(
        "off",
        f"{steps} steps < {thresholds.min_steps}: a skipped step costs too much on short schedules",
    ), threshold


def resolve_compile(
    requested: str,
    hardware: HardwareProfile,
    *,
    tier: str,
    regions: tuple[str, ...],
    denied: Mapping[str, str],
    gguf: bool,
    cache_may_engage: bool,
) -> tuple[Resolved[str], bool]:
    """(``regional`` or ``off``, fullgraph)."""
    if requested not in COMPILE_REQUESTS:
        raise ValueError(f"compile {requested!r} is not one of {', '.join(COMPILE_REQUESTS)}")
    fullgraph = not cache_may_engage
    if requested == "off":
        return explicit("off", "pinned off"), False
    blocker = None
    if not regions:
        blocker = "the family names no repeated blocks to compile"
    elif "compile" in denied:
        blocker = denied["compile"]
    elif gguf:
        blocker = "torch.compile fails on GGUF-quantised weights"
    if blocker:
        source = auto if requested == "auto" else explicit
        return source("off", blocker), False
    note = "" if fullgraph else "; fullgraph off, an auto step cache may engage"
    if requested == "on":
        return explicit("regional", f"regional compile of {', '.join(regions)} (dynamic shapes){note}"), fullgraph
    if tier in ("off", "eager"):
        return auto("off", f"speed tier {tier}"), False
    if not hardware.cuda:
        return auto("off", f"{hardware.vendor}: compiling costs 30-40 s up front for little gain"), False
    return auto(
        "regional", f"regional compile of {', '.join(regions)} with dynamic shapes{note}"
    ), fullgraph


def resolve_fp16_accumulation(
    hardware: HardwareProfile,
    *,
    dtype: str,
    tier: str,
    denied: Mapping[str, str],
    env: Mapping[str, str],
) -> Resolved[bool]:
    """fp16 accumulation doubles fp16 GEMM throughput on consumer tensor cores.

    bf16 compute is bit-identical with it (the flag touches fp16 GEMMs only),
    so it engages on any active tier; fp16 compute drifts (finite, no black
    frames), so only the ``max`` tier takes that trade.
    """
    if env.get(FP16_ACCUM_KILL_SWITCH, "") not in ("", "0"):
        return auto(False, f"{FP16_ACCUM_KILL_SWITCH} is set")
    if hardware.vendor != "nvidia":
        return auto(False, "not a CUDA (NVIDIA) device")
    if not hardware.consumer:
        return auto(False, "datacenter GPUs keep fp32 accumulation at full rate; no gain")
    if not hardware.torch_fp16_accumulation:
        return auto(False, "this torch does not expose allow_fp16_accumulation (2.7+ does)")
    if "fp16_accumulation" in denied:
        return auto(False, denied["fp16_accumulation"])
    if tier == "off":
        return auto(False, "speed tier off")
    if dtype == "bf16":
        return auto(True, "bf16 compute is bit-identical with it; fp16 parts (VAE, encoders) gain")
    if dtype == "fp16" and tier == "max":
        return auto(True, "fp16 compute on the max tier: ~2x GEMM throughput for a small finite drift")
    return auto(False, f"{dtype} compute drifts with it; only the max tier takes that trade")


def resolve_threads(hardware: HardwareProfile, requested: int | None) -> Resolved[int | None]:
    """CPU threads for compute-bound GEMMs: half the logical cores.

    Hyperthreads add scheduling contention, not throughput, to GEMM work.
    """
    if requested is not None:
        return explicit(requested)
    if hardware.vendor != "cpu":
        return auto(None, "GPU compute: torch's default CPU threads")
    count = hardware.cpu_count
    if count is None:
        return auto(8, "cpu count unknown: 8")
    return auto(max(1, count // 2), f"{count} logical cores // 2 (hyperthreads add contention to GEMMs)")
