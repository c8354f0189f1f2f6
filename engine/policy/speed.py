"""Speed controls: the tier, step cache, compile, fp16 accumulation, TF32, threads.

The attention kernel has its own module (:mod:`engine.policy.attention`),
whose names are re-exported here.

Each resolver takes the speed tier (off | eager | default | max) and the
family's optimisation deny list, and returns a :class:`Resolved` whose reason
names the rule that fired.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.hardware.profile import HardwareProfile
from engine.requests.choices import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from engine.policy.attention import (  # noqa: F401 - re-exported: the attention rules' old home
    ATTENTION_INSTALL_ENV as ATTENTION_INSTALL_ENV,
    CUDNN_ATTENTION_DTYPES as CUDNN_ATTENTION_DTYPES,
    CUDNN_ATTENTION_MIN_CAPABILITY as CUDNN_ATTENTION_MIN_CAPABILITY,
    HUB_KERNELS as HUB_KERNELS,
    OPTIONAL_BACKENDS as OPTIONAL_BACKENDS,
    PYTORCH_WHEEL_INDEX as PYTORCH_WHEEL_INDEX,
    XFORMERS_FOR_TORCH as XFORMERS_FOR_TORCH,
    AttentionBackend as AttentionBackend,
    attention_arch_error as attention_arch_error,
    install_requirement as install_requirement,
    resolve_attention as resolve_attention,
)
from engine.policy.compatibility import pair_refusal
from engine.policy.resolved import Resolved, Source, auto, explicit
from engine.requests.choices import COMPILE_REQUESTS, SPEED_REQUESTS, SPEED_TIERS, STEP_CACHES

if TYPE_CHECKING:
    from engine.contract.types import Checkpoint, FamilySpec


FP16_ACCUM_KILL_SWITCH = "DIFFUSION_ENGINE_DISABLE_FP16_ACCUM"
#: Set to 0 to run the denoiser's blocks as diffusers wrote them (no eager fusions).
EAGER_FUSIONS_KILL_SWITCH = "DIFFUSION_ENGINE_EAGER_FUSIONS"
#: torch's own switch: with it set, ``torch.compile`` does nothing.
DYNAMO_DISABLE_ENV = "TORCHDYNAMO_DISABLE"

#: A dense model compiles before this image (1-based) of a loaded session:
#: compiling costs 30-60 s, which a one-off image should not pay.
COMPILE_FROM_IMAGE = 3


@dataclass(frozen=True)
class StepCacheThresholds:
    """First-Block-Cache: engage at this many steps, with these residual thresholds."""

    min_steps: int = 20
    threshold: float = 0.08
    quantised_threshold: float = 0.12


def resolve_speed_tier(requested: str, *, quantised: bool, label: str = "transformer") -> Resolved[str]:
    """The speed tier; ``auto`` decides from the transformer the plan holds.

    A dense, unquantised transformer with no speed request runs on ``off``:
    nothing is engaged (no compile, no step cache, no fp16 accumulation, native
    attention), so its images are bit-identical to stock diffusers, the
    earlier system's later default. A quantised (or GGUF) transformer runs on
    ``default``: its kernels gain from compile and it already differs from
    the dense reference.
    """
    if requested not in SPEED_REQUESTS:
        raise ValueError(f"speed tier {requested!r} is not one of {', '.join(SPEED_REQUESTS)}")
    if requested != "auto":
        return explicit(requested)
    if quantised:
        return auto("default", f"a quantised {label}: compile on CUDA, auto step cache, safe fp16 accumulation")
    return auto("off", f"a dense {label} with no speed request: nothing engaged, images bit-identical to "
                "stock diffusers (speed=default: compile and step cache)")


def resolve_step_cache(
    requested: str,
    steps: int,
    *,
    quantised: bool,
    tier: str,
    denied: Mapping[str, str],
    thresholds: StepCacheThresholds = StepCacheThresholds(),
    unsupported: str | None = None,
    mag_ratios: str | None = None,
    sea_cache: bool = False,
) -> tuple[Resolved[str], float]:
    """(the step cache, residual threshold). Re-asked at every generate.

    :param unsupported: why this pipeline cannot carry the cache (its call
        sets no cache context: the first step would fail), or None.
    :param mag_ratios: where the checkpoint's calibrated MagCache ratios live
        (``Checkpoint.mag_ratios``); None: MagCache is not offered.
    :param sea_cache: whether the call's pipeline can carry SeaCache (the family table's
        ``PipelineLayout.sea_cache_pipelines``); False: SeaCache is not offered.
    """
    if requested not in STEP_CACHES:
        raise ValueError(f"step cache {requested!r} is not one of {', '.join(STEP_CACHES)}")
    threshold = thresholds.quantised_threshold if quantised else thresholds.threshold
    source: Source = "auto" if requested == "auto" else "explicit"
    if "step_cache" in denied:
        return Resolved("off", source, f"step cache unavailable: {denied['step_cache']}", requested), threshold
    if requested == "off":
        return explicit("off", "pinned off"), threshold
    if unsupported and (requested in ("fbcache", "magcache", "seacache") or tier != "off"):
        return Resolved("off", source, f"step cache unavailable: {unsupported}", requested), threshold
    if requested == "fbcache":
        return explicit("fbcache", f"pinned on (residual threshold {threshold})"), threshold
    if requested == "taylorseer":  # asked for only: auto keeps First-Block-Cache (docs/benchmarks.md's drift)
        return explicit("taylorseer", f"pinned on: TaylorSeer (after {TAYLORSEER_WARMUP} full steps, a full step "
                                      f"every {TAYLORSEER_INTERVAL}, the ones between predicted from the last full "
                                      "ones by a first-order Taylor series)"), threshold
    if requested == "magcache":  # asked for only, where the checkpoint's ratios are known
        if mag_ratios is None:
            return Resolved("off", source, "step cache unavailable: MagCache skips steps by magnitude ratios "
                            "calibrated on the checkpoint, and its table names none (fbcache and taylorseer "
                            "need none)", requested), threshold
        return explicit("magcache", f"pinned on: MagCache (the checkpoint's calibrated magnitude ratios; the "
                                    f"first {MAGCACHE_RETENTION:.0%} of steps full, then a step skipped while the "
                                    f"accumulated error stays under {MAGCACHE_THRESHOLD}, at most "
                                    f"{MAGCACHE_MAX_SKIPS} in a row)"), threshold
    if requested == "seacache":  # asked for only, where the pipeline hands SeaCache its schedule
        if not sea_cache:
            return Resolved("off", source, "step cache unavailable: SeaCache follows the schedule (step, sigma) "
                            "that the pipeline hands its cache context, with a diffusers adapter for the "
                            "denoiser, and the family table lists no such pipeline for this call (fbcache and "
                            "taylorseer need none)", requested), threshold
        return explicit("seacache", f"pinned on: SeaCache (the block stack's residual reused while the "
                                    f"accumulated change of the latents' spectrally filtered indicator stays "
                                    f"under {SEACACHE_THRESHOLD}; the first and last steps full, at most "
                                    f"{SEACACHE_MAX_SKIPS} in a row)"), threshold
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


#: TaylorSeer's schedule: full steps before it predicts, and one full step in this many after.
TAYLORSEER_WARMUP, TAYLORSEER_INTERVAL = 3, 3
#: MagCache's settings (its paper's and diffusers' defaults): the accumulated error a skip may
#: reach, the most steps skipped in a row, and the share of the first steps always run.
MAGCACHE_THRESHOLD, MAGCACHE_MAX_SKIPS, MAGCACHE_RETENTION = 0.06, 3, 0.2
#: SeaCache's settings (its paper's and diffusers' defaults): the accumulated relative change
#: a reuse may reach and the most steps reused in a row (the first and last step always run).
SEACACHE_THRESHOLD, SEACACHE_MAX_SKIPS = 0.25, 2


def step_cache_offers(family: FamilySpec, checkpoint: Checkpoint | None, pipeline_class: str | None) -> dict[str, Any]:
    """What the family's table offers the caches that need it, for a call of ``pipeline_class``:
    :func:`resolve_step_cache`'s ``mag_ratios`` and ``sea_cache`` (the planner and the loaded
    session, which re-asks per call with the pipeline the call runs, read them here alike)."""
    return {"mag_ratios": checkpoint.mag_ratios if checkpoint is not None else None,
            "sea_cache": pipeline_class in family.pipeline.sea_cache_pipelines}


def step_cache_unsupported(
    cache_context_pipelines: tuple[str, ...] | None, pipeline_class: str | None
) -> str | None:
    """Why ``pipeline_class`` cannot carry the step cache, from the family table.

    First-Block-Cache keeps its state per cache context, which the pipeline's
    call must open around each denoiser call; a pipeline that opens none
    fails at the first cached step ("No cache context is set"). None when the
    table does not say (the runtime checks the loaded pipeline) or the class
    is listed.
    """
    if cache_context_pipelines is None or not pipeline_class:
        return None
    if pipeline_class in cache_context_pipelines:
        return None
    return f"{pipeline_class} sets no cache context around its denoiser calls (First-Block-Cache would fail)"


def resolve_compile(
    requested: str,
    hardware: HardwareProfile,
    *,
    tier: str,
    regions: tuple[str, ...],
    denied: Mapping[str, str],
    gguf: bool,
    cache_may_engage: bool,
    memory: str = "resident",
    dtype: str = "bf16",
    env: Mapping[str, str] | None = None,
) -> tuple[Resolved[str], bool]:
    """(``regional`` or ``off``, fullgraph).

    fullgraph is off wherever hooks run inside the denoiser: a step cache
    that is pinned on or may engage later (First-Block-Cache under a
    fullgraph-compiled transformer crashes), and offload hooks (group /
    model / sequential), under which a fullgraph compile fails at the first
    step.

    :param cache_may_engage: First-Block-Cache is pinned on, or auto and may
        engage at some generate of the session.
    :param memory: the memory mode whose hooks run (``resident``: none).

    Which of these forbid fullgraph, and why, is the compatibility table's
    answer (:mod:`engine.policy.compatibility`).
    """
    if requested not in COMPILE_REQUESTS:
        raise ValueError(f"compile {requested!r} is not one of {', '.join(COMPILE_REQUESTS)}")
    source: Source = "auto" if requested == "auto" else "explicit"
    if requested == "off":
        return explicit("off", "pinned off"), False
    blocker = _compile_blocker(regions, denied, gguf=gguf and requested == "auto", tier=tier, env=env or {})
    if blocker:
        return Resolved("off", source, blocker, requested), False
    conflicts = (
        ("step_cache", "fbcache" if cache_may_engage else "off"),
        ("memory", memory),
        ("quant", "gguf" if gguf else "none"),
    )
    notes = [why for axis, value in conflicts if (why := pair_refusal("compile", "fullgraph", axis, value))]
    fullgraph = not notes
    note = "".join(f"; fullgraph off ({n})" for n in notes)
    if requested == "on":
        return explicit("regional", f"regional compile of {', '.join(regions)} (dynamic shapes){note}"), fullgraph
    if tier in ("off", "eager"):
        return auto("off", f"speed tier {tier}"), False
    if not hardware.cuda:
        return auto("off", f"{hardware.vendor}: compiling costs 30-40 s up front for little gain"), False
    if dtype == "fp16":
        return auto(
            "off",
            "fp16 compute (a card without native bf16): inductor's kernels gain little there "
            "and the compile costs 30-60 s; compile=on to force it",
        ), False
    return auto(
        "regional", f"regional compile of {', '.join(regions)} with dynamic shapes{note}"
    ), fullgraph


def _compile_blocker(
    regions: tuple[str, ...], denied: Mapping[str, str], *, gguf: bool, tier: str, env: Mapping[str, str]
) -> str | None:
    if env.get(DYNAMO_DISABLE_ENV, "") not in ("", "0"):
        return f"{DYNAMO_DISABLE_ENV}={env[DYNAMO_DISABLE_ENV]}: torch.compile is disabled in this process"
    if not regions:
        return "the family names no repeated blocks to compile"
    if "compile" in denied:
        return denied["compile"]
    if gguf and tier != "max":
        return "GGUF weights: compiled (regionally) only on the max tier, where the 30-60 s compile pays"
    return None


def schedule_compile(compiled: Resolved[str], *, quantised: bool) -> tuple[Resolved[str], int]:
    """(``compiled`` with its schedule in the reason, the image that compiles first).

    A dense auto compile waits for the third image of a loaded session, so a
    one-off image does not pay 30-60 s; an explicit ``on`` and a
    torchao-quantised transformer (whose speed comes from the compiled
    kernels) compile at load (image 1).
    """
    if compiled.value != "regional" or compiled.source == "explicit" or quantised:
        return compiled, 1
    reason = (
        f"{compiled.reason}; compiled before image {COMPILE_FROM_IMAGE} of a session "
        "(a one-off image does not pay the 30-60 s compile)"
    )
    return dataclasses.replace(compiled, reason=reason), COMPILE_FROM_IMAGE


def resolve_eager_fusions(sites: int, *, tier: str, env: Mapping[str, str]) -> Resolved[bool]:
    """The blocks' modulation and gated residuals as one ``torch.addcmul`` each, on every
    tier but ``off`` (it rounds once where stock rounds twice: not bit-identical)."""
    if env.get(EAGER_FUSIONS_KILL_SWITCH, "").strip() == "0":
        return auto(False, f"{EAGER_FUSIONS_KILL_SWITCH}=0: the blocks run as diffusers wrote them")
    if not sites:
        return auto(False, "the family's table names no block to fuse")
    if tier == "off":
        return auto(False, "speed tier off: the blocks run as diffusers wrote them (bit-identical images)")
    return auto(True, f"modulation and gated residuals as one torch.addcmul each, in {sites} block class(es) "
                "(one kernel and no temporary where there were two; equal up to float rounding)")


def resolve_tf32(hardware: HardwareProfile, *, tier: str) -> Resolved[bool]:
    """TF32 for fp32 matmuls: a precision trade, so only the max tier takes it."""
    if hardware.vendor != "nvidia" or not hardware.native_bf16:
        return auto(False, "TF32 needs an NVIDIA GPU of sm80+")
    if tier != "max":
        return auto(False, "TF32 changes fp32 results; only the max tier trades exactness for speed")
    return auto(True, "max tier: fp32 matmuls (encoders, VAE in fp32) run in TF32")


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


#: A denoiser below this many bf16 GB (50 M parameters) is too narrow to feed two CPU threads:
#: on the tiny models two threads used about 8x the CPU of one for the same steps (OpenMP's
#: barriers spin while a partner thread is descheduled; FACTS.md, "CPU compute").
NARROW_DENOISER_GB = 0.1


def resolve_threads(hardware: HardwareProfile, requested: int | None,
                    env: Mapping[str, str] | None = None, denoiser_gb: float | None = None) -> Resolved[int | None]:
    """CPU threads for compute-bound GEMMs: one per physical core, one where the denoiser is too
    narrow to feed two (``denoiser_gb`` below :data:`NARROW_DENOISER_GB`).

    SMT siblings share one core's FPU, so a second thread on it adds contention, not GEMM
    throughput; a core without a sibling is a whole core (on a 2-core machine without SMT
    halving the logical count ran every CPU path on half the machine). Where the topology is
    unknown, the earlier rule: half the logical cores (written for SMT machines). An
    ``OMP_NUM_THREADS`` in the environment is the user's (or a scheduler's) say, and wins
    over the count: processes that share the cores set it.
    """
    if requested is not None:
        return explicit(requested)
    if hardware.vendor != "cpu":
        return auto(None, "GPU compute: torch's default CPU threads")
    omp = (env or {}).get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return auto(int(omp), f"OMP_NUM_THREADS={omp} in the environment")
    count, cores = hardware.cpu_count, hardware.physical_cores
    if denoiser_gb is not None and denoiser_gb < NARROW_DENOISER_GB and (cores or count or 2) > 1:
        return auto(1, f"a {denoiser_gb * 1000:.0f} MB denoiser is too narrow to feed two threads: one (two spin at "
                       "their barriers, about 8x the CPU for the same steps on tiny models)")
    if cores is not None:
        if count is not None and count > cores:
            return auto(cores, f"{cores} physical cores of {count} logical (SMT siblings share one core's FPU)")
        return auto(cores, f"{cores} physical cores, no SMT siblings: one thread each")
    if count is None:
        return auto(8, "cpu count unknown: 8")
    return auto(max(1, count // 2), f"{count} logical cores // 2 (topology unknown; hyperthreads add contention to GEMMs)")
