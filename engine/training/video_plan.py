"""What a video family's LoRA run trains: the clip window and, on a two-expert base, the expert.

Pure (no torch), run in the preflight before anything is evicted.

The window is ``frames`` frames at the checkpoint's fps (``--frames``, else the
family's ``VideoSpec.training_frames``), on the VAE's lattice (4k+1 for a causal video VAE)
and inside the range it renders; an image family refuses ``--frames``.

A two-expert base (``transformer`` takes the steps at or above
the pipeline's ``boundary_ratio`` of the schedule, ``transformer_2`` those
below) trains the expert ``--expert`` names, or both; each expert sees only the
sigmas of its range, so what it learns is what it will be asked at inference.
A base with one denoiser refuses ``--expert`` (TI2V-5B has one expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import stored
from engine.contract.types import Checkpoint, FamilySpec, VideoSpec
from engine.errors import PreflightError
from engine.policy.resolved import Resolved, auto, explicit
from engine.preflight.clips import ClipWindow
from engine.preflight.source import ModelSource
from engine.requests.training import TrainingConfig

#: The boundary (a pipeline's ``boundary_ratio``) of the published two-expert checkpoints, for a hub
#: base whose config is not read before the run.
DEFAULT_BOUNDARY = 0.875


@dataclass(frozen=True)
class ExpertChoice:
    """Which denoisers a run trains, and the sigmas each one sees ([low, high))."""

    #: ``high``, ``low`` or ``both``.
    name: str
    #: The pipeline's boundary: sigmas at or above it belong to the high-noise expert.
    boundary: float
    #: The pipeline components trained, the high-noise one first where both are.
    components: tuple[str, ...]

    def sigma_range(self) -> tuple[float, float]:
        """The sigmas drawn for the run: one expert's range, or the whole schedule for both."""
        if self.name == "high":
            return self.boundary, 1.0
        if self.name == "low":
            return 0.0, self.boundary
        return 0.0, 1.0

    def to_dict(self) -> dict[str, object]:
        low, high = self.sigma_range()
        return {"expert": self.name, "boundary": self.boundary, "components": list(self.components),
                "sigmas": [low, high]}


def video_spec_of(family: FamilySpec, checkpoint: Checkpoint | None) -> VideoSpec | None:
    return family.video_of(checkpoint) if family.rendering.output == "frames" else None


def early_window(source: ModelSource | None, config: TrainingConfig) -> ClipWindow | None:
    """The window the dataset's clips are judged against, from the base the preflight resolved
    first; None where it did not resolve or the window is refused (the clips are then decoded in
    full, and the run is refused for that reason by the plan)."""
    if source is None:
        return None
    try:
        return clip_window(source.family, source.checkpoint, config)
    except PreflightError:
        return None


def clip_window(family: FamilySpec, checkpoint: Checkpoint | None, config: TrainingConfig) -> ClipWindow | None:
    """The run's window (None for an image family, which refuses ``frames``)."""
    spec = video_spec_of(family, checkpoint)
    if spec is None:
        if config.frames is not None:
            raise PreflightError(
                f"frames={config.frames}: {family.label} trains on images; --frames is for video families "
                "(drop it)", code="invalid_video_shape",
            )
        return None
    frames = config.frames or spec.training_frames or spec.default_frames
    if not spec.in_range(frames):
        label = (checkpoint or family.default_checkpoint).label
        nearest = " and ".join(str(n) for n in spec.nearest(frames))
        why = (f"its VAE compresses time by {spec.frame_step}, so a clip is {spec.lattice} frames"
               if not spec.on_lattice(frames) else f"its clips run {spec.min_frames} to {spec.max_frames} frames")
        raise PreflightError(f"frames={frames}: {label} cannot train on that clip ({why}); the nearest valid "
                             f"counts are {nearest}", code="invalid_video_shape")
    sound = family.training.sound if family.training is not None else None
    return ClipWindow(frames=frames, fps=float(spec.fps), short=config.short_clips,
                      sound_rate=(sound.sample_rate or spec.audio_rate) if sound is not None else None,
                      sound_channels=sound.channels if sound is not None else 2)


def expert_choice(family: FamilySpec, base: ModelSource, config: TrainingConfig) -> Resolved[ExpertChoice] | None:
    """The experts a run trains (None: one denoiser), or a refusal of an ``expert`` that makes no sense."""
    index = _index(base)
    present = _experts_present(family, base, index)
    if not present:
        if config.expert is not None:
            label = (base.checkpoint or family.default_checkpoint).label if base.checkpoint else family.label
            raise PreflightError(
                f"expert={config.expert}: {base.location} ({label}) has one denoiser, not a high- and a "
                "low-noise expert; drop --expert", code="no_second_expert",
            )
        return None
    boundary = _boundary(index)
    second = present[0]
    components = {"high": (family.pipeline.denoiser,), "low": (second,), "both": (family.pipeline.denoiser, second)}
    name = config.expert or "both"
    choice = ExpertChoice(name, boundary, components[name])
    low, high = choice.sigma_range()
    why = {"high": f"the high-noise expert ({family.pipeline.denoiser}) on sigmas {low:g} to {high:g}",
           "low": f"the low-noise expert ({second}) on sigmas {low:g} to {high:g}",
           "both": f"both experts, each on its own sigmas (boundary {boundary:g}): two LoRA files"}[name]
    return explicit(choice, why) if config.expert else auto(choice, why)


def _experts_present(family: FamilySpec, base: ModelSource, index: dict[str, object] | None) -> tuple[str, ...]:
    """The family's experts this base holds: a pipeline folder's ``model_index.json`` says; a hub
    base by its checkpoint (one with a second expert's guidance has the second expert)."""
    if index is not None:
        return tuple(name for name in family.pipeline.experts if _named(index.get(name)))
    checkpoint = base.checkpoint
    return family.pipeline.experts if checkpoint is not None and checkpoint.expert_guidance is not None else ()


def _named(entry: object) -> bool:
    """A ``model_index.json`` component entry that names a class (``[library, class]``, not ``[null, null]``)."""
    return isinstance(entry, list) and bool(entry) and entry[0] is not None


def _boundary(index: dict[str, object] | None) -> float:
    value = (index or {}).get("boundary_ratio")
    return float(value) if isinstance(value, (int, float)) and 0 < value < 1 else DEFAULT_BOUNDARY


def _index(base: ModelSource) -> dict[str, object] | None:
    if base.kind != "pipeline":
        return None
    try:
        data = stored.read_json(Path(base.location) / "model_index.json")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["ExpertChoice", "clip_window", "early_window", "expert_choice", "video_spec_of"]
