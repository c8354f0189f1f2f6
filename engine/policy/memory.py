"""Memory plan: keep everything resident, or offload, from sizes and budget.

budget = free device memory - reserve, where reserve is max(2 GiB, 10% of
VRAM) (20% on unified memory, which the OS shares): the reserve is taken
from what is free, since what other processes hold is not ours to plan
with. A plan is resident when weights + base overhead fit within 0.85 x
budget (and the brief peak of building a quantised transformer fits what is
free); model offload when the largest component does (the transformer then
stays on the device for every step of an image); group offload (the
transformer streamed block by block, every step) otherwise, or sequential
offload for a torchao-quantised transformer, whose tensor subclasses and
group-offload streams are known to clash on device placement.

Unified memory (Apple silicon, integrated NVIDIA GPUs) has one pool: moving
a component "off" the device frees nothing, so it is planned resident or
refused; the refusal compares weights + overhead with the budget itself (no
0.85 headroom: the pool pages rather than fragments) and is never made
when free memory is unknown. A CPU run may spill into free swap, slowly; beyond RAM and swap it
is refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import PreflightError
from engine.hardware.profile import GIB_IN_GB, HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import MEMORY_MODES



@dataclass(frozen=True)
class MemoryThresholds:
    """Starting values of the memory knobs; a config may override them."""

    resident_fraction: float = 0.85
    reserve_min_gb: float = 2 * GIB_IN_GB
    reserve_fraction: float = 0.10
    unified_reserve_fraction: float = 0.20
    #: CUDA context and the activations floor.
    overhead_gb: float = 2 * GIB_IN_GB
    #: The floor before the activation guard raised ``overhead_gb`` for a request's size
    #: (None: not raised). Unified memory's oversize check reads it: a shared pool pages
    #: the soft activation headroom rather than failing on it.
    base_overhead_gb: float | None = None


@dataclass(frozen=True)
class Components:
    """GB each part holds in the planned dtype and scheme."""

    transformer_gb: float
    #: Peak while building the transformer (dense weights before quantising).
    transformer_transient_gb: float
    text_encoders_gb: float
    vae_gb: float
    quantised: bool = False
    #: A ControlNet loaded beside the denoiser (0: none). It runs with the
    #: denoiser at every step, so offload holds both at once.
    controlnet_gb: float = 0.0
    #: How reasons name the denoiser ("transformer", "UNet").
    denoiser_label: str = "transformer"


@dataclass(frozen=True)
class MemoryEstimate:
    components: Components
    overhead_gb: float
    budget_gb: float
    resident_gb: float
    peak_gb: float

    def to_dict(self) -> dict[str, object]:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()} | {
            "components": {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self.components).items()}
        }


def reserve_gb(hardware: HardwareProfile, thresholds: MemoryThresholds = MemoryThresholds()) -> float:
    """What the plan leaves untouched: max(2 GiB, 10% of the total; 20% unified)."""
    fraction = thresholds.unified_reserve_fraction if hardware.unified_memory else thresholds.reserve_fraction
    return max(thresholds.reserve_min_gb, fraction * hardware.total_memory_gb)


def budget_gb(hardware: HardwareProfile, thresholds: MemoryThresholds = MemoryThresholds()) -> float:
    """Free memory less the reserve (the total less the reserve when free is unknown).

    A 16 GiB card with 15.87 GiB free plans with 13.87 GiB, not with the
    14 GiB "total - reserve" would claim while something else holds memory.
    """
    free = hardware.total_memory_gb if hardware.free_memory_gb is None else hardware.free_memory_gb
    return max(0.0, free - reserve_gb(hardware, thresholds))


def plan_memory(
    parts: Components,
    hardware: HardwareProfile,
    requested: str = "auto",
    thresholds: MemoryThresholds = MemoryThresholds(),
) -> tuple[Resolved[str], MemoryEstimate]:
    """The memory mode for ``parts`` on ``hardware``, and the arithmetic behind it."""
    if requested not in ("auto", *MEMORY_MODES):
        raise PreflightError(
            f"memory mode {requested!r} is not one of auto, {', '.join(MEMORY_MODES)}",
            code="invalid_memory_mode",
        )
    budget = budget_gb(hardware, thresholds)
    overhead = thresholds.overhead_gb
    limit = thresholds.resident_fraction * budget
    weights = parts.transformer_gb + parts.text_encoders_gb + parts.vae_gb + parts.controlnet_gb
    resident = weights + overhead
    denoising = f"{parts.denoiser_label} + ControlNet" if parts.controlnet_gb else parts.denoiser_label
    base = base_overhead_gb(thresholds)  # what the encoders need: they never see the image
    alone = {denoising: parts.transformer_gb + parts.controlnet_gb + overhead,  # what one-at-a-time offload holds
             "text encoders": parts.text_encoders_gb + base, "VAE": parts.vae_gb + overhead}
    biggest = max(alone, key=alone.__getitem__)
    largest = alone[biggest]
    # Building a quantised transformer on the fly holds its dense weights
    # briefly: that peak may use the reserve, but not more than is free.
    hard = hardware.total_memory_gb if hardware.free_memory_gb is None else hardware.free_memory_gb
    build_peak = weights - parts.transformer_gb + parts.transformer_transient_gb
    fits = {
        "resident": resident <= limit and build_peak <= hard,
        "model_offload": largest <= limit and parts.transformer_transient_gb <= hard,
    }
    peaks = {"resident": resident, "model_offload": largest}

    def estimate(mode: str) -> MemoryEstimate:
        return MemoryEstimate(parts, overhead, budget, resident, peaks.get(mode, overhead))

    with_controlnet = f", ControlNet {parts.controlnet_gb:.1f} included" if parts.controlnet_gb else ""
    needed = f"{resident:.1f} GB resident (weights {weights:.1f}{with_controlnet} + overhead {overhead:.1f})"
    sizing = f"{needed} vs 0.85 x {budget:.1f} GB budget"
    if hardware.vendor == "cpu":  # host RAM: the budget itself, then free swap (no headroom fraction)
        return _cpu_plan(resident, budget, hardware, requested, f"{needed} vs {budget:.1f} GB budget"), \
            estimate("resident")
    if hardware.unified_memory:
        # One pool: weights + base overhead against the budget itself (the 0.85 and the
        # size-grown activation headroom are soft there: it pages); open when free is unknown.
        if hardware.free_memory_gb is None:
            return _unified_plan(None, requested, f"{needed}; free memory unknown, not checked", hardware), \
                estimate("resident")
        checked = f"weights {weights:.1f} + base overhead {base:.1f} GB vs {budget:.1f} GB budget"
        return _unified_plan(weights + base <= budget, requested, f"{needed}; {checked}", hardware), \
            estimate("resident")
    if requested != "auto":
        if requested in fits and not fits[requested]:
            # A faster mode that does not fit falls to the next one that does
            # (the earlier system's rule); ``--strict`` refuses the fallback.
            chosen, chosen_estimate = plan_memory(parts, hardware, "auto", thresholds)
            return Resolved(
                chosen.value, "explicit", f"memory={requested} does not fit ({sizing}); next that does: "
                f"{chosen.value}: {chosen.reason}", requested,
            ), chosen_estimate
        return explicit(requested), estimate(requested)
    if fits["resident"]:
        return auto("resident", f"fits: {sizing}"), estimate("resident")
    if fits["model_offload"]:
        return auto(
            "model_offload",
            f"{sizing} does not fit; one component at a time does ({largest:.1f} GB peak), "
            f"so the {parts.denoiser_label} stays on the device for every step (streaming its blocks "
            "would move it every step)",
        ), estimate("model_offload")
    mode, reason = _streamed(parts.quantised, biggest, largest, largest - (base if biggest == "text encoders"
                                                                         else overhead), budget)
    return auto(mode, reason), estimate(mode)


def _streamed(quantised: bool, biggest: str, largest: float, weights: float, budget: float) -> tuple[str, str]:
    """The mode when even the biggest part alone does not fit, and why in numbers: the part's own
    weights (both experts of a two-expert denoiser), with the overhead, against the budget."""
    too_big = (f"even the {biggest} alone ({weights:.1f} GB of weights, {largest:.1f} GB with overhead) "
               f"does not fit 0.85 x the {budget:.1f} GB budget")
    if quantised:
        return "sequential_offload", f"{too_big}; sequential offload (group offload's streams clash with " \
                                     "torchao-quantised weights)"
    return "group_offload", f"{too_big}; its blocks are streamed"


def base_overhead_gb(thresholds: MemoryThresholds) -> float:
    """The overhead before the activation guard raised it for the image's size (what a part
    that never sees the image, such as the text encoders, needs beside its weights)."""
    raised = thresholds.overhead_gb
    return raised if thresholds.base_overhead_gb is None else min(raised, thresholds.base_overhead_gb)


def _cpu_plan(resident: float, budget: float, hardware: HardwareProfile, requested: str, sizing: str) -> Resolved[str]:
    """Resident in RAM, spilling into free swap if it must; refused beyond both."""
    swap = hardware.swap_free_gb or 0.0
    if resident <= budget:
        return auto("resident", f"CPU: every component in host RAM ({sizing})")
    if resident <= budget + swap:
        return auto(
            "resident",
            f"CPU: {sizing}; {resident - budget:.1f} GB spill into swap ({swap:.1f} GB free): slow",
        )
    # An explicit mode changes nothing here: on a CPU every mode keeps the weights in RAM,
    # so beyond RAM and swap it is refused as auto is (the load would meet the OOM killer).
    asked = f" (memory={requested} keeps every weight in RAM on a CPU too)" if requested != "auto" else ""
    raise PreflightError(
        f"the model needs {sizing}; this machine's RAM and free swap ({swap:.1f} GB) cannot hold it{asked}. "
        "Choose a quantised transformer (quant=int8), a smaller model, or add swap.",
        code="insufficient_memory",
    )


def _unified_plan(fits: bool | None, requested: str, sizing: str, hardware: HardwareProfile) -> Resolved[str]:
    """One memory pool: offload frees nothing, so resident or refused (``fits``
    None: free memory unknown, so nothing is refused)."""
    shared = f"{hardware.device_name} shares one memory pool with the host"
    if fits is False:
        raise PreflightError(
            f"the model needs {sizing}; {shared}, so offloading frees nothing. "
            "Free memory (close other apps), choose a quantised transformer, or a smaller model.",
            code="insufficient_memory",
        )
    if requested in ("auto", "resident"):
        source = auto if requested == "auto" else explicit
        return source("resident", f"fits: {sizing} ({shared})")
    return Resolved(
        "resident", "explicit", f"{requested} not applicable: {shared}, offloading frees nothing; resident ({sizing})",
        requested, "not applicable",
    )


def mode_rank(mode: str) -> int:
    """Lower is faster: resident < model < group < sequential offload."""
    return MEMORY_MODES.index(mode)
