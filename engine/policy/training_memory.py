"""How much device memory a LoRA training run will use, before it starts.

Pure and torch-free: a family's table (its measured activation figures and
LoRA target shapes), the base's size (table or file headers) and the
request's shape (resolution, batch, rank, checkpointing) in, a breakdown
out. The trainer runs in two phases, and the estimate is the larger:

- **caching**: text encoders and VAE on the device to encode captions and
  images once (an nf4 base is already there: bitsandbytes quantises it on
  the device at load; a base loaded after caching, a two-expert one's, is not);
- **training**: the encoders are moved off; the frozen base in its
  precision (quantised on the host first, so never dense on the device),
  the LoRA parameters with their gradients and AdamW state, and the
  activations a step keeps for backward.

Both phases add the runtime's fixed overhead (CUDA context, cuBLAS
workspace, allocator slack). ``bench/memory_accuracy.py`` measures real
steps against this arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from engine.hardware.profile import GIB_IN_GB
from engine.policy.schemes import SCHEME_SIZES
from engine.contract.types import ActivationFigures, FamilySpec, LoraTargetShape

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

@dataclass(frozen=True)
class TrainingShape:
    """The parts of a training request that decide its memory."""

    resolution: int = 512
    #: Frames of each example (a video family's clip window; 1 for images).
    frames: int = 1
    batch_size: int = 1
    lora_rank: int = 16
    #: None: the engine decides (off when the run fits without it).
    gradient_checkpointing: bool | None = False
    #: Target module names; None for the family's defaults.
    lora_targets: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TrainingMemoryThresholds:
    """Starting values; a config may override them."""

    #: CUDA context, cuBLAS workspace and allocator slack.
    runtime_overhead_gb: float = 1.0 * GIB_IN_GB
    #: fp32 LoRA weight + its gradient + AdamW's two moments.
    lora_bytes_per_param: int = 16
    #: Kept free of the available memory for fragmentation.
    margin_fraction: float = 0.05


@dataclass(frozen=True)
class TrainingMemoryEstimate:
    """A run's device memory, by component, in decimal GB."""

    mode: str
    base_gb: float
    #: Where the base's size came from: "table" or "file headers".
    base_source: str
    lora_params: int
    lora_gb: float
    activations_gb: float
    text_encoders_gb: float
    vae_gb: float
    overhead_gb: float
    caching_peak_gb: float
    training_peak_gb: float
    #: False where the family has no measured activation figures: the
    #: activations are then unknown and the peak a lower bound.
    sized: bool = True

    @property
    def peak_gb(self) -> float:
        return max(self.caching_peak_gb, self.training_peak_gb)

    def to_dict(self) -> dict[str, object]:
        data = {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}
        data["peak_gb"] = round(self.peak_gb, 2)
        return data

    def lines(self) -> list[str]:
        """The breakdown as a person reads it."""
        act = f"{self.activations_gb:6.2f} GB" if self.sized else "  unknown (family has no activation figures)"
        return [
            f"frozen base ({self.mode}, {self.base_source}) {self.base_gb:6.2f} GB",
            f"LoRA ({self.lora_params:,} params + grads + AdamW) {self.lora_gb:6.2f} GB",
            f"activations {act}",
            f"text encoders (while caching) {self.text_encoders_gb:6.2f} GB",
            f"VAE (while caching) {self.vae_gb:6.2f} GB",
            f"runtime overhead {self.overhead_gb:6.2f} GB",
            f"peak: caching {self.caching_peak_gb:.2f} GB, training {self.training_peak_gb:.2f} GB "
            f"-> {self.peak_gb:.2f} GB",
        ]


@dataclass(frozen=True)
class BaseFacts:
    """What the estimate knows of the base it will train on."""

    dense_gb: float
    text_encoders_gb: float
    vae_gb: float
    source: str = "table"
    #: (name, shape) of the denoiser's tensors when its headers were read.
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: The trainer loads the base after the captions and latents are cached (a two-expert
    #: base's experts): the caching phase never holds it, an nf4 one included.
    loaded_after_caching: bool = False


def lora_target_shapes(
    shapes: Iterable[tuple[str, tuple[int, ...]]], targets: Sequence[str]
) -> tuple[LoraTargetShape, ...]:
    """Every 2-D weight whose module name ends in a target, grouped by shape.

    peft matches a target against the end of a module's dotted name
    (``to_out.0`` matches ``...attn.to_out.0``), and so does this.
    """
    counts: dict[tuple[str, int, int], int] = defaultdict(int)
    for name, shape in shapes:
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        for target in targets:
            if module == target or module.endswith("." + target):
                counts[(target, shape[1], shape[0])] += 1
                break
    return tuple(LoraTargetShape(t, i, o, n) for (t, i, o), n in sorted(counts.items()))


#: Base precisions whose frozen weights stay dense (bf16) on the device:
#: the fp8 and mxfp8 training recipes keep bf16 weights and cast them per
#: matmul, so they save time, not weight memory.
DENSE_WEIGHT_MODES: frozenset[str] = frozenset({"bf16", "fp16", "none", "fp8", "mxfp8"})


def base_gb(family: FamilySpec, dense_gb: float, mode: str) -> float:
    """Device GB of the frozen base a ``mode`` run holds (int8 and nf4 at
    their steady size: quantised before the base reaches the device)."""
    if mode in DENSE_WEIGHT_MODES:
        return dense_gb
    factor = family.quantisation.factor(mode) or SCHEME_SIZES[mode].steady
    return dense_gb * factor


def estimate_training_memory(
    family: FamilySpec,
    base: BaseFacts,
    mode: str,
    shape: TrainingShape = TrainingShape(),
    *,
    compute: str = "bf16",
    thresholds: TrainingMemoryThresholds = TrainingMemoryThresholds(),
) -> TrainingMemoryEstimate:
    """The device memory of a ``mode`` run of ``shape`` on ``base``.

    :param compute: the compute dtype (``fp32`` on a CPU run, whose weights
        are held in fp32 too: twice the bf16 bytes).
    """
    figures = family.training.memory
    targets = shape.lora_targets or family.lora.targets
    scale = _Scale.of(family, base, targets)
    dtype_bytes = BYTES[compute]
    weight_scale = dtype_bytes / 2  # sizes are bf16 GB
    dense_mode = mode in DENSE_WEIGHT_MODES
    held = base_gb(family, base.dense_gb, mode) * (weight_scale if dense_mode else 1.0)
    lora_params = sum(t.lora_params(shape.lora_rank) for t in scale.targets)
    lora_gb = lora_params * thresholds.lora_bytes_per_param / 1e9
    activations = (
        _activation_elements(figures.activations, scale, shape,
                             family.rendering.geometry.clip_tokens(shape.frames, shape.resolution))
        * dtype_bytes / 1e9
        if figures is not None else 0.0
    )
    overhead = thresholds.runtime_overhead_gb
    encoders = base.text_encoders_gb * weight_scale
    vae = base.vae_gb * weight_scale
    on_device_while_caching = held if mode == "nf4" and not base.loaded_after_caching else 0.0
    return TrainingMemoryEstimate(
        mode=mode,
        base_gb=held,
        base_source=base.source,
        lora_params=lora_params,
        lora_gb=lora_gb,
        activations_gb=activations,
        text_encoders_gb=encoders,
        vae_gb=vae,
        overhead_gb=overhead,
        caching_peak_gb=encoders + vae + on_device_while_caching + overhead,
        training_peak_gb=held + lora_gb + activations + overhead,
        sized=figures is not None,
    )


def usable_gb(available_gb: float, thresholds: TrainingMemoryThresholds = TrainingMemoryThresholds()) -> float:
    """What a run may plan to use of ``available_gb``, after the margin."""
    return available_gb * (1 - thresholds.margin_fraction)


@dataclass(frozen=True)
class _Scale:
    """How the measured base relates to the full-size model the figures describe.

    A fine-tune or a tiny test pipeline of the same architecture has other
    widths and depths: activations scale with width (per token) and with the
    number of blocks, both read from the LoRA targets' shapes in the headers.
    """

    targets: tuple[LoraTargetShape, ...]
    width: float = 1.0
    depth: float = 1.0

    @classmethod
    def of(cls, family: FamilySpec, base: BaseFacts, targets: Sequence[str]) -> _Scale:
        table = family.training.memory.lora_targets if family.training.memory else ()
        table = tuple(t for t in table if t.target in targets)
        if not base.shapes:
            return cls(table)
        measured = lora_target_shapes(base.shapes, targets)
        if not table or not measured:
            return cls(measured)
        reference = _largest(table)
        own = next((t for t in measured if t.target == reference.target), _largest(measured))
        width = own.in_features / reference.in_features
        depth = _total(measured, own.target) / _total(table, reference.target)
        return cls(measured, width, depth)


def _largest(shapes: tuple[LoraTargetShape, ...]) -> LoraTargetShape:
    return max(shapes, key=lambda t: (t.count, t.in_features))


def _total(shapes: tuple[LoraTargetShape, ...], target: str) -> int:
    return sum(t.count for t in shapes if t.target == target)


def _activation_elements(figures: ActivationFigures, scale: _Scale, shape: TrainingShape, image: int) -> float:
    """Elements a step keeps for backward; ``image``: the tokens of one sample (its family's geometry)."""
    text = figures.text_tokens
    blocks = figures.blocks * scale.depth
    full = figures.block_per_image_token * image + figures.block_per_text_token * text
    kept = (
        figures.checkpointed_block_per_image_token * image
        + figures.checkpointed_block_per_text_token * text
    )
    outside = figures.outside_per_image_token * image + figures.outside_per_text_token * text
    if shape.gradient_checkpointing and figures.checkpointed_outside_per_image_token is not None:
        outside = (
            figures.checkpointed_outside_per_image_token * image
            + (figures.checkpointed_outside_per_text_token or 0.0) * text
        )
    # Under checkpointing every block keeps its inputs and one block at a
    # time is recomputed in full during backward.
    per_sample = (blocks * kept + full) if shape.gradient_checkpointing else blocks * full
    return (per_sample + outside) * scale.width * shape.batch_size


def with_blocks(figures: ActivationFigures, blocks: int) -> ActivationFigures:
    """The same per-token figures for a denoiser of ``blocks`` blocks (benchmarks)."""
    return replace(figures, blocks=blocks)
