"""The plugin contract: every hook a model-family plugin can implement.

Hook names carry the ``engine_`` prefix. No spec has default argument values
(pluggy drops them silently). ``firstresult`` hooks answer "who owns this";
they stop at the first non-None result, and the engine's built-in table
plugin (``trylast``) answers each of them from the registered
:class:`~engine.contract.types.FamilySpec`, so a family only writes code where its
table cannot express the rule. Collected hooks gather things to combine.

The plugin author's guide, ``docs/plugins.md``, documents every hook below;
a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from engine.hardware.profile import HardwareProfile
    from engine.contract.types import (
        CallShape,
        Checkpoint,
        ComponentSizes,
        FamilySpec,
        OptimizationDeny,
        Purpose,
        QuantDeny,
        TrainingObjective,
    )

PROJECT_NAME = "diffusion_engine"
ENTRY_POINT_GROUP = "diffusion_engine.families"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------
# Registration
# -------------------------------------------------------------------------


@hookspec
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    """Register model families by calling ``register(spec)`` once per family.

    :param register: the host's callback; it validates the spec and refuses a
        family name or alias another plugin already claimed.

    Collected: every plugin's implementation is called. Return nothing.
    """


# -------------------------------------------------------------------------
# Sizing and quantisation (inference and training policy)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def engine_component_sizes(
    family: FamilySpec, checkpoint: Checkpoint | None
) -> ComponentSizes | None:
    """bf16 GB of the transformer, text encoders and VAE of ``checkpoint``.

    :param checkpoint: None asks for the family's default checkpoint.
    :return: the sizes, or None to let another plugin answer.

    Stops at first non-None result.
    """


@hookspec
def engine_quant_deny(family: FamilySpec, purpose: Purpose) -> Iterable[QuantDeny] | None:
    """Schemes ``family`` must not use for ``purpose``, each with its reason.

    :param purpose: ``"inference"`` or ``"training"``.
    :return: denies to add (or None). Collected and unioned: any plugin can
        deny a scheme; none can allow one another plugin denied.
    """


@hookspec(firstresult=True)
def engine_dense_base(family: FamilySpec, repo: str) -> str | None:
    """The dense base to use instead of ``repo`` when ``repo`` is pre-quantised.

    :param repo: a hub id or a local folder name.
    :return: the dense base's repo id, or None when ``repo`` is not
        pre-quantised (it can be trained or quantised as it is).

    Stops at first non-None result.
    """


@hookspec
def engine_optimization_deny(family: FamilySpec) -> Iterable[OptimizationDeny] | None:
    """Speed optimisations ``family`` must not get, each with its reason:
    ``fp16_accumulation``, ``step_cache``, ``compile`` or an attention backend.

    Collected and unioned, like ``engine_quant_deny``.
    """


# -------------------------------------------------------------------------
# Training
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def engine_training_precision_modes(
    family: FamilySpec, hardware: HardwareProfile
) -> tuple[str, ...] | None:
    """Base precisions ``family``'s trainer can hold its frozen base in.

    The family's own capability, before the engine's machine rules (native
    bf16, CUDA, torchao, fp8/mxfp8 capability) and the deny lists filter it.
    An empty tuple means the trainer ignores ``base_precision`` (a UNet
    trainer, for instance).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_training_objective(family: FamilySpec) -> TrainingObjective | None:
    """What the LoRA trainer needs from this family: the objective (flow
    matching or epsilon / v prediction), timestep sampling, and the dotted
    paths of the family's prompt-encoding and latent-packing functions.

    Stops at first non-None result.
    """


# -------------------------------------------------------------------------
# Runtime
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def engine_compile_regions(family: FamilySpec) -> tuple[str, ...] | None:
    """Class names of the repeated blocks to compile regionally.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_build_tiny_pipeline(family: FamilySpec, path: Path, checkpoint: Checkpoint | None) -> Path | None:
    """Write a tiny random-weight diffusers pipeline of ``family``'s real
    architecture to ``path`` (for tests, demos and benchmarks; no hub needed);
    of ``checkpoint``'s own pipeline class where one is given (None: the
    family's default). An implementation may leave ``checkpoint`` out of its
    signature (pluggy passes only the arguments it names).

    :return: the folder written, or None when this plugin cannot build it.

    Stops at first non-None result.
    """


# -------------------------------------------------------------------------
# Runtime code a table cannot say (defaults: diffusers' own integrations)
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def engine_lora_add(
    family: FamilySpec, denoiser: object, config: object, adapter_name: str
) -> str | None:
    """Add a trainable LoRA adapter (a peft ``LoraConfig``) to ``denoiser``.

    :return: how it was added, in a few words (shown in the run's events), or
        None to let another plugin answer. The engine's default uses
        diffusers' peft integration (``add_adapter``) where the class has it,
        else peft's ``inject_adapter_in_model``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_lora_state_dict(family: FamilySpec, denoiser: object, adapter_name: str) -> dict[str, Any] | None:
    """The adapter's weights in peft's keys (``<module>.lora_A.weight``), for
    saving. The engine's default is peft's ``get_peft_model_state_dict``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_lora_load(
    family: FamilySpec, pipeline: object, state_dict: dict[str, Any], adapter_name: str
) -> str | None:
    """Load a LoRA (``state_dict`` in peft's keys for the denoiser, no
    component prefix) into the loaded pipeline's denoiser as ``adapter_name``,
    where the pipeline has no diffusers LoRA loader mixin.

    :return: how it was loaded, or None to let another plugin answer. The
        engine's default uses ``load_lora_adapter`` where the denoiser has it,
        else peft's ``inject_adapter_in_model`` + ``set_peft_model_state_dict``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_generate_kwargs(
    family: FamilySpec, pipeline: object, kwargs: dict[str, Any], shape: CallShape
) -> dict[str, Any] | None:
    """The keyword arguments to call the loaded ``pipeline`` with.

    :param kwargs: the engine's arguments for this request (prompt, steps,
        guidance under ``family.pipeline.guidance_kwarg``, size, generator, ...), already
        limited to what the pipeline's call accepts.
    :param shape: the request's shape as decided (size, count, a clip's frames and fps;
        plugin API 2): what a pipeline that spells them its own way is passed. An
        implementation that does not name it keeps working (pluggy passes what it names).
    :return: the arguments to use instead (start from a copy of ``kwargs``),
        or None to call with ``kwargs`` as they are.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_pipeline_sound(family: FamilySpec, pipeline: object, result: object) -> list[Any] | None:
    """The sound of each clip one pipeline call gave (plugin API 2), for a family whose
    ``VideoSpec.audio`` is set.

    :param result: the pipeline call's return value.
    :return: one :class:`~engine.contract.sound.Sound` (or None) per clip, in the order of
        ``engine_pipeline_output``'s; or None to let another plugin answer. The engine's
        default reads ``result.audio`` (``(batch, channels, samples)``) at ``VideoSpec.audio_rate``,
        else at the pipeline's ``vocoder.config.output_sampling_rate``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def engine_pipeline_output(family: FamilySpec, pipeline: object, result: object) -> list[Any] | None:
    """What one pipeline call gave, one entry per prompt of the call.

    :param result: the pipeline call's return value (``FluxPipelineOutput``,
        a video pipeline's output with ``frames``...).
    :return: a list with one entry per prompt: a PIL image for a family whose
        ``output`` is ``images``, the clip's frames (a list of PIL images) for
        ``frames``; or None to let another plugin answer. The engine's default
        reads ``result.images`` or ``result.frames`` (PIL or arrays in 0-1).

    Stops at first non-None result.
    """
