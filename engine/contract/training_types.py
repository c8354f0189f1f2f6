"""The training half of a family's data sheet: its objective, the LoRA
target shapes and measured activation figures its memory estimate reads,
and the recipe defaults where they differ from the engine's.

Frozen dataclasses of builtins, like the rest of :mod:`engine.contract.types`,
which re-exports every name here (plugins import them from there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


Prediction = Literal["flow_matching", "epsilon", "v_prediction"]


@dataclass(frozen=True, init=False)
class TrainingObjective:
    """What one generic LoRA trainer loop needs to know about a family.

    The functions the loop calls (prompt encoding, latent encoding and
    packing, the model call) live in the family's one runtime module,
    :attr:`FamilySpec.runtime_module`, imported only when a run starts.
    """

    #: What the denoiser predicts: ``flow_matching`` (noise - x0 at a sigma),
    #: ``epsilon`` or ``v_prediction`` (on the runtime's DDPM schedule).
    prediction: Prediction
    #: How training timesteps are drawn.
    timestep_sampling: Literal["logit_normal", "uniform", "shifted_sigmoid"]

    def __init__(self, prediction: Prediction,
                 timestep_sampling: Literal["logit_normal", "uniform", "shifted_sigmoid"],
                 runtime_module: str | None = None) -> None:
        object.__setattr__(self, "prediction", prediction)
        object.__setattr__(self, "timestep_sampling", timestep_sampling)
        if runtime_module is not None:  # plugin API 0 named the runtime module here
            from engine.contract.plugin_api import deprecate

            deprecate("TrainingObjective(runtime_module=...)")
            object.__setattr__(self, "_legacy_runtime_module", runtime_module)

    @property
    def runtime_module(self) -> str | None:
        """Plugin API 0's spelling, read back (deprecated: read ``FamilySpec.runtime_module``).
        The module an API 0 plugin passed here, else None (the family's table holds it)."""
        from engine.contract.plugin_api import deprecate

        deprecate("TrainingObjective.runtime_module")
        return getattr(self, "_legacy_runtime_module", None)


@dataclass(frozen=True)
class SoundTraining:
    """How the trainer trains a clip's sound beside its picture (an audio-video family).

    The clip's track, resampled to the family's ``VideoSpec.audio_rate`` and ``channels``,
    is encoded once by the runtime module's ``encode_sound`` and noised beside the picture's
    latents at the same drawn time, shifted by ``flow_shift`` (a model that samples its sound
    on another schedule: shift 3.0 beside its picture's 12.0, say); its velocity comes from
    the runtime's ``predict_with_sound``. The step's loss is the picture's plus
    ``loss_weight`` times the sound's, each reported (``loss_video``, ``loss_sound``); a
    clip with no sound trains the picture alone. (Plugin API 2.)
    """

    #: The sound's own flow shift (None: the picture's).
    flow_shift: float | None = None
    #: The sound loss's weight in the step's loss.
    loss_weight: float = 1.0
    #: Channels trained (2: stereo).
    channels: int = 2
    #: The rate a clip's sound is read at for training (the audio VAE's input rate, where its
    #: encoder reads another rate than the vocoder writes); None: ``VideoSpec.audio_rate``.
    sample_rate: int | None = None


@dataclass(frozen=True)
class LoraTargetShape:
    """One kind of Linear a LoRA adapts: its name suffix, shape and how many
    the full-size denoiser holds (``to_q``, 3072 -> 3072, x 57)."""

    target: str
    in_features: int
    out_features: int
    count: int

    def lora_params(self, rank: int) -> int:
        """Parameters a rank-``rank`` adapter adds over every such layer (A and B)."""
        return self.count * rank * (self.in_features + self.out_features)


@dataclass(frozen=True)
class ActivationFigures:
    """Elements a LoRA training step keeps for backward, per token.

    Measured (``bench/memory_accuracy.py --derive``) on a real-width,
    reduced-depth denoiser and carried here as data, like ``quant_factors``:
    never guessed. Multiply by the compute dtype's bytes. An *image token* is
    one token of the family's ``LatentGeometry`` (a 16x16-pixel patch by
    default: a 2x2 patch of an 8x-downsampled latent; 32x32 for a 32x VAE with
    patch 1), so one figure serves any resolution. *Text tokens* are the encoded prompt positions the denoiser
    attends over (``text_tokens`` of them at training time).
    """

    #: Saved per image / text token by one repeated block, no checkpointing.
    block_per_image_token: float
    block_per_text_token: float
    #: Kept per image / text token by one block under gradient checkpointing
    #: (its inputs, recomputed in backward).
    checkpointed_block_per_image_token: float
    checkpointed_block_per_text_token: float
    #: Saved per token outside the repeated blocks (embedders, final layers).
    outside_per_image_token: float
    outside_per_text_token: float
    #: Repeated blocks in the full-size denoiser.
    blocks: int
    #: Prompt positions the trainer encodes captions to.
    text_tokens: int
    #: Outside the blocks under gradient checkpointing, where it differs
    #: (a UNet: diffusers recomputes its resnets too); None: as above.
    checkpointed_outside_per_image_token: float | None = None
    checkpointed_outside_per_text_token: float | None = None


@dataclass(frozen=True)
class TrainingMemoryFigures:
    """What a family's LoRA training step holds besides its frozen weights."""

    activations: ActivationFigures
    #: Every Linear the default LoRA targets adapt, in the full-size model.
    lora_targets: tuple[LoraTargetShape, ...]


@dataclass(frozen=True)
class TrainingDefaults:
    """A family's trainer defaults where its published recipe differs from the engine's.

    ``flow_shift``: the sigma shift of flow-matching timestep sampling
    (``shift * s / (1 + (shift - 1) * s)``); 1.0 leaves sampling as is.
    ``flow_shift_auto``: the shift follows the image token count the way the
    family's scheduler shifts at inference (its ``base_shift`` / ``max_shift``
    over ``base_seq_len`` .. ``max_seq_len`` tokens, exponential), so a
    1328 px run trains on the sigmas it will sample with.
    """

    learning_rate: float | None = None
    warmup_steps: int | None = None
    flow_shift: float = 1.0
    flow_shift_auto: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096
    #: Where the figures come from (the published recipe / scheduler config).
    source: str = ""
