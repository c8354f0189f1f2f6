"""The request models every face validates: one definition of the limits.

The HTTP server validates its JSON bodies with these models and the CLI
builds the same models from its flags, so a bound or a multiple-of rule is
checked the same way, before anything loads, whichever face a request came
in through. Every model is strict (``true`` is not a step count, ``"3"`` is
not an int), refuses lone surrogates anywhere in its data (they cannot be
encoded as UTF-8: tokenizers, paths and responses would fail on them later),
and bounds every string.

:class:`GenerateBody` is THE generate request (prompt, sizes, steps, seed,
count, LoRAs and any later image inputs); :class:`PlanControls` the plan's
controls; training uses :class:`engine.requests.training.TrainingConfig`.
:func:`describe_problems` turns a validation error into one sentence per
problem, naming each field the way the caller's face spells it (a flag at
the terminal, a JSON field over HTTP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from engine.requests.inference import InferenceRequest
from engine.requests.choices import MAX_KEEP_ALIVE_S as MAX_KEEP_ALIVE_S  # re-exported
from engine.requests.loras import lora_choices
from engine.requests.batch import batch_items
from engine.requests.controls import PLAN_CONTROLS, Control
from engine.stored import lone_surrogate_in

# -- the shared limits ------------------------------------------------------------

#: Image sides: multiples of 16 (VAE stride 8 x patch 2, the strictest any
#: family needs, so no family ever rounds a size it was given) and at least
#: 64 (below that a latent shrinks to one pixel in the denoiser's lower
#: blocks and normalisation fails).
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 64, 4096, 16
MAX_STEPS = 200
MAX_PLAN_STEPS = 1000
MAX_COUNT = 8
MAX_SEED = 2**63 - 1
MAX_LORAS = 8
#: A clip's bounds before the family's own lattice and range are checked (engine.policy.video).
MAX_FRAMES, MAX_FPS = 1025, 120

Side = Annotated[int, Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Guidance = Annotated[float, Field(ge=0, le=50, allow_inf_nan=False)]
Prompt = Annotated[str, Field(max_length=4000)]
#: A family, checkpoint or control name: short, so a refusal can name it.
Name = Annotated[str, Field(min_length=1, max_length=200)]
#: A model, dataset or output path (PATH_MAX); the confinement checks each part.
PathText = Annotated[str, Field(min_length=1, max_length=4096)]


def refuse_lone_surrogates(data: Any) -> Any:
    """``data`` unchanged, or a ValueError when a string (or key) in it is not valid Unicode."""
    if lone_surrogate_in(data):
        raise ValueError("a string contains a lone surrogate (an unpaired \\ud800-\\udfff "
                         "escape); send valid Unicode text")
    return data


class Body(BaseModel):
    """Strict, closed (unknown fields refused), valid Unicode only."""

    # Schemas are built on a model's first use: a face that validates one body (``plan``) does
    # not pay for the others (the module imports in 30 ms instead of 95).
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)


# -- images -------------------------------------------------------------------------


class LoraBody(Body):
    """A LoRA file (or training run folder) and the scale to apply it at."""

    path: PathText
    scale: Annotated[float, Field(ge=-8, le=8, allow_inf_nan=False)] = 1.0
    #: Apply the modules that match and skip the rest (the plan counts both); else a LoRA with a
    #: module the model lacks is refused.
    partial: bool = False


#: LoRAs one request may name.
Loras = Annotated[list[LoraBody], Field(max_length=MAX_LORAS)]


class _PlanControlsBase(Body):
    """The plan's controls; ``auto`` leaves a control to the engine (it says why)."""

    def request(self) -> InferenceRequest:
        return InferenceRequest(**self.model_dump(include=set(PLAN_FIELDS)))


def _plan_field(control: Control) -> tuple[Any, Any]:
    """A plan control's type and default, from its row in the control table."""
    if control.choices:
        return Literal[control.choices], control.default
    if control.field == "steps":
        return Annotated[int, Field(ge=1, le=MAX_PLAN_STEPS)] | None, None
    if control.field in ("threads", "gpus"):
        return Annotated[int, Field(ge=1, le=1024)] | None, None
    if isinstance(control.default, bool):
        return bool, control.default
    return Name, control.default


#: The plan's controls, one field per row of :data:`engine.requests.controls.PLAN_CONTROLS`.
PLAN_FIELDS: tuple[str, ...] = tuple(c.field for c in PLAN_CONTROLS)
PlanControls = create_model(  # type: ignore[call-overload]
    "PlanControls", __base__=_PlanControlsBase, __module__=__name__,
    **{c.field: _plan_field(c) for c in PLAN_CONTROLS},
)
PlanControls.__doc__ = _PlanControlsBase.__doc__


class _Shaped(PlanControls):
    """Plan controls and the request's shape the plan is made for: a plan for 121 frames is
    not the plan for 33 (the activations, the tiled decode and the dtype fit all grow)."""

    width: Side | None = None
    height: Side | None = None
    count: Count = 1
    #: A video model's clip length (None: the checkpoint's default clip).
    frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None

    def request(self) -> InferenceRequest:
        import dataclasses

        return dataclasses.replace(super().request(), width=self.width, height=self.height, count=self.count,
                                   frames=self.frames)


class PlanBody(_Shaped):
    """A plan for a model (path or hub id), or for a family's table, at the request's shape."""

    model: PathText | None = None
    family: Name | None = None
    checkpoint: Name | None = None
    base: PathText | None = None
    #: A ControlNet folder that will load beside ``model``, sized into the plan.
    controlnet: PathText | None = None


class LoadBody(_Shaped):
    """A load, planned at the shape its generates will ask (a video model's clip length)."""

    model: PathText
    family: Name | None = None
    base: PathText | None = None
    loras: Loras = Field(default_factory=list)
    #: LoRAs will be switched on the loaded pipeline (keeps them unfused).
    lora_switching: bool = False
    #: A diffusers ControlNet folder to load beside the model.
    controlnet: PathText | None = None


#: The most input images one edit takes (a multi-image edit checkpoint's own limit applies first:
#: its table's ``reference_images``, at most this; the most a built-in family takes is ten).
MAX_INPUT_IMAGES = 16

#: A keep-alive in seconds: up to a week.
KeepAliveSeconds = Annotated[float, Field(ge=0, le=MAX_KEEP_ALIVE_S, allow_inf_nan=False)]


class GenerateBody(Body):
    """The generate request: what to draw, how big, how many, with which LoRAs."""

    prompt: Prompt
    #: The model to run on, as the OpenAI API's ``model``: a model folder or file (on the server:
    #: under its model roots, or by the name ``GET /v1/models`` lists), loaded first if another
    #: is in; omitted, or a name the loaded model answers to: the loaded one.
    model: PathText | None = None
    negative_prompt: Prompt | None = None
    steps: Steps | None = None
    guidance: Guidance | None = None
    #: A two-expert video model's guidance for its low-noise expert (the pipeline's
    #: ``guidance_scale_2``); omitted: the checkpoint's. Refused for a model with one denoiser.
    guidance_2: Guidance | None = None
    width: Side | None = None
    height: Side | None = None
    seed: Seed = 0
    count: Count = 1
    #: Replace the loaded pipeline's LoRAs (``[]`` removes them; omitted keeps them).
    loras: Loras | None = None
    #: An input image path: img2img (with ``strength``), or an instruction
    #: edit on an edit checkpoint; fitted within width x height. A list: the images a
    #: multi-image edit checkpoint edits together (its table says how many it takes).
    image: PathText | Annotated[list[PathText], Field(min_length=1, max_length=MAX_INPUT_IMAGES)] | None = None
    #: A mask image path, white where ``image`` is redrawn (inpaint).
    mask_image: PathText | None = None
    strength: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    #: One seed / prompt per image (a list of one is repeated to the other's
    #: length); image k replays alone with seed k.
    seeds: Annotated[list[Seed], Field(min_length=1, max_length=MAX_COUNT)] | None = None
    prompts: Annotated[list[Prompt], Field(min_length=1, max_length=MAX_COUNT)] | None = None
    #: Images per forward; omitted: as the memory plan allows.
    batch: Count | None = None
    #: A control image path for the ControlNet loaded with the model, turned
    #: into its map by ``control_preprocess`` (canny edges, or none: as given).
    control_image: PathText | None = None
    control_preprocess: Literal["canny", "none"] = "canny"
    control_scale: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    #: A video model's clip: frames on its lattice (checked against the family's before
    #: anything loads) and the frame rate it is stamped with; omitted: the checkpoint's.
    frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    fps: Annotated[int, Field(ge=1, le=MAX_FPS)] | None = None
    #: Frames each window of a long clip renders (each after the first continues from the last
    #: frame before it); omitted: the checkpoint's trained length, where the clip is longer.
    window_frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] | None = None
    #: Seconds the model stays loaded after this call before an idle unload (as Ollama's
    #: ``keep_alive``; 0: unload when done); omitted: the server's ``--keep-alive``.
    keep_alive: KeepAliveSeconds | None = None

    @model_validator(mode="after")
    def _inputs_agree(self) -> GenerateBody:
        if self.mask_image is not None and self.image is None:
            raise ValueError("mask_image needs image: inpainting redraws part of a given image")
        if self.control_image is not None and (self.image is not None or self.mask_image is not None):
            raise ValueError("control_image is served alone (ControlNet text-to-image); drop image / mask_image")
        if self.strength is not None and self.image is None:
            raise ValueError("strength applies to an input image; give image too, or drop strength")
        lengths = {len(self.seeds or ()), len(self.prompts or ())} - {0, 1}
        if len(lengths) > 1:
            raise ValueError("seeds and prompts have different lengths; give one seed per prompt, or one of either")
        if (self.seeds or self.prompts) and self.count != 1:
            raise ValueError("count and seeds / prompts both set the number of images; give one")
        return self

    def input_images(self) -> list[str]:
        """The input image paths, as a list (one, several for a multi-image edit, or none)."""
        return [] if self.image is None else [self.image] if isinstance(self.image, str) else list(self.image)

    def images(self) -> list[Any]:
        """The images this request makes, each with its own prompt and seed
        (:class:`~engine.requests.batch.BatchItem`, as the engine runs them)."""
        return batch_items(self.prompt, prompts=self.prompts or (), seeds=self.seeds or (), seed=self.seed,
                           count=self.count, negative_prompt=self.negative_prompt)

    def options(self) -> dict[str, object]:
        """The keyword options of :meth:`engine.Engine.images.generate` this request sets (prompt and LoRAs apart)."""
        return self.model_dump(exclude={"prompt", "loras", "model"}, exclude_none=True)


def lora_bodies(texts: list[str], *, partial: bool = False) -> list[dict[str, object]]:
    """``PATH[:SCALE]`` strings (the CLI's ``--lora``; ``--lora-partial`` for ``partial``) as
    ``{"path", "scale", "partial"}`` request items."""
    return [{"path": c.path, "scale": c.scale, "partial": partial} for c in lora_choices(texts)]


# -- problems, in the caller's words ---------------------------------------------------

#: pydantic's phrasing -> the engine's ("Input should be greater than 0" -> "must be greater than 0").
_PHRASES = (("Input should be ", "must be "), ("Value error, ", ""), ("Input ", ""))


def describe_problems(
    error: ValidationError | Iterable[Any], name_of: Callable[[tuple[int | str, ...]], str] | None = None
) -> list[str]:
    """One sentence per problem: ``NAME must be ...`` (with the value given for scalars).

    ``name_of`` maps a problem's location (pydantic's ``loc``) to the name the
    user typed: a ``--flag`` at the terminal; the dotted field path by default.
    """
    sentences = []
    for problem in error.errors() if isinstance(error, ValidationError) else error:
        loc = tuple(problem.get("loc", ()))
        name = name_of(loc) if name_of is not None else ".".join(str(p) for p in loc) or "request"
        message = str(problem.get("msg", ""))
        for before, after in _PHRASES:
            if message.startswith(before):
                message = after + message[len(before):]
                break
        given = problem.get("input")
        shown = f" (got {given!r})" if isinstance(given, int | float | str) and len(repr(given)) <= 40 else ""
        multiple = (problem.get("ctx") or {}).get("multiple_of")
        if problem.get("type") == "multiple_of" and isinstance(given, int) and isinstance(multiple, int):
            # Never rounded silently: say which sizes would do.
            below = given // multiple * multiple
            shown += f"; {below} or {below + multiple} would do"
        sentences.append(f"{name} {message}{shown}")
    return sentences
