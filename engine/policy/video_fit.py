"""Video on this machine: the clip a checkpoint renders by default, its plan here, and the
longest clip that would do better. Pure (the planner's own answer, frames varied).

A clip's headroom grows with its frames (:func:`engine.policy.activations.video_overhead_gb`),
so whether a video model runs resident, offloads or cannot run at all depends on
the clip as much as on the weights. ``info`` and ``doctor`` ask this module, so a user
learns before a load that "121 frames offload here; 49 run resident" rather than
finding it in a progress bar.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from engine.contract.types import Checkpoint, FamilySpec, VideoSpec
from engine.errors import EngineError
from engine.policy.inference import ModelFacts, Plan, plan_inference
from engine.requests.inference import InferenceRequest

if TYPE_CHECKING:
    from engine.contract.plugins import Registry
    from engine.hardware.profile import HardwareProfile
    from engine.policy.available import AvailableMemory


@dataclass(frozen=True)
class ClipFit:
    """One video checkpoint's default clip on this machine, and the longest clip that does better."""

    checkpoint: str
    frames: int
    width: int
    height: int
    fps: int
    #: Whether the default clip plans here at all.
    ok: bool
    #: The plan in brief (dtype, scheme, memory mode), or ``refused``.
    does: str
    #: The memory mode's reason, or the refusal's message.
    reason: str
    #: The longest shorter clip at the default size that does better: plans at all where the
    #: default is refused, plans resident where the default offloads (None: none does).
    better_frames: int | None = None
    #: That clip's plan in brief.
    better_does: str | None = None

    @property
    def seconds(self) -> float:
        return round(self.frames / self.fps, 2)

    def hint(self) -> str | None:
        """The flag that would do better, in words (None: nothing shorter helps)."""
        if self.better_frames is None:
            return None
        seconds = self.better_frames / self.fps
        return f"--frames {self.better_frames} ({seconds:.1f} s at {self.fps} fps) plans {self.better_does} here"

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "seconds": self.seconds, "hint": self.hint()}


def clip_fit(
    registry: Registry, family: FamilySpec, checkpoint: Checkpoint, hardware: HardwareProfile,
    available: AvailableMemory | None = None,
) -> ClipFit:
    """Plan ``checkpoint``'s default clip here; where it is refused or not resident, find the
    longest clip on the lattice (at the default size) that plans, or plans resident."""
    video = family.video_of(checkpoint)
    if video is None:
        raise ValueError(f"{family.label} renders images, not clips")
    facts = ModelFacts(family, checkpoint, registry.component_sizes(family, checkpoint))

    def plan_at(frames: int) -> Plan:
        return plan_inference(registry, facts, hardware, InferenceRequest(frames=frames), available=available)

    width, height = video.default_size
    clip = functools.partial(ClipFit, checkpoint.name, video.default_frames, width, height, video.fps)
    try:
        plan = plan_at(video.default_frames)
    except EngineError as error:
        better = _longest(video, lambda n: _plans(plan_at, n) is not None)
        return clip(ok=False, does="refused", reason=error.message, better_frames=better,
                       better_does=_brief(_plans(plan_at, better)) if better else None)
    offloads = plan.value("memory_mode") != "resident" and not (hardware.vendor == "cpu" or hardware.unified_memory)
    better = _longest(video, lambda n: _resident(_plans(plan_at, n))) if offloads else None
    return clip(ok=True, does=_brief(plan), reason=plan["memory_mode"].reason, better_frames=better,
                   better_does=_brief(_plans(plan_at, better)) if better else None)


def _plans(plan_at: Callable[[int], Plan], frames: int) -> Plan | None:
    try:
        return plan_at(frames)
    except EngineError:
        return None


def _resident(plan: Plan | None) -> bool:
    return plan is not None and plan.value("memory_mode") == "resident"


def _brief(plan: Plan | None) -> str:
    """A plan in a few words: dtype, transformer scheme, memory mode."""
    if plan is None:
        return "nothing"
    return f"{plan.value('dtype')} {plan.value('transformer_quant') or 'dense'}, {plan.value('memory_mode')}"


def _longest(video: VideoSpec, good: Callable[[int], bool]) -> int | None:
    """The longest clip below the default, on the lattice, for which ``good`` holds (good is
    monotone in frames: a shorter clip holds less, so a binary search finds it)."""
    counts = [n for n in range(video.min_frames, video.default_frames, video.frame_step) if video.in_range(n)]
    low, high, best = 0, len(counts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if good(counts[middle]):
            best, low = counts[middle], middle + 1
        else:
            high = middle - 1
    return best
