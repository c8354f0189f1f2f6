"""Request bodies: strict JSON types, bounded sizes, one definition of the limits.

Every body is strict (``true`` is not a step count, ``"3"`` is not an int),
refuses lone surrogates anywhere in its JSON (they cannot be encoded as
UTF-8: tokenizers, paths and responses would fail on them later), and bounds
every string. The image limits (:data:`Side`, :data:`Steps`, :data:`Count`)
are defined once and used by the native and the OpenAI-compatible bodies, so
no route accepts more work than another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.policy.inference import InferenceRequest
from engine.training.config import TrainingConfig

# -- the shared limits ------------------------------------------------------------

#: Image sides: multiples of 16 (VAE stride 8 x patch 2, the strictest any
#: family needs) and at least 64 (below that a latent shrinks to one pixel
#: in the denoiser's lower blocks and normalisation fails).
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 64, 4096, 16
MAX_STEPS = 200
MAX_COUNT = 8

Side = Annotated[int, Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Prompt = Annotated[str, Field(max_length=4000)]
#: A family, checkpoint or control name: short, so a refusal can name it.
Name = Annotated[str, Field(min_length=1, max_length=200)]
#: A model, dataset or output path (PATH_MAX); the confinement checks each part.
PathText = Annotated[str, Field(min_length=1, max_length=4096)]

_SIDE = TypeAdapter(Side)
_CONFIG_FIELDS = TrainingConfig.model_fields


def refuse_lone_surrogates(data: Any) -> Any:
    """``data`` unchanged, or a ValueError when a string (or key) in it is not valid Unicode."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string contains a lone surrogate (an unpaired \\ud800-\\udfff "
                                 "escape); send valid Unicode text") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return data


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)


# -- images -------------------------------------------------------------------------


class LoraBody(Body):
    """A LoRA under the server's LoRA roots and the scale to apply it at."""

    path: PathText
    scale: Annotated[float, Field(ge=-8, le=8, allow_inf_nan=False)] = 1.0


#: LoRAs one request may name.
Loras = Annotated[list[LoraBody], Field(max_length=8)]


class PlanControls(Body):
    dtype: Name = "auto"
    quant: Name = "auto"
    memory: Name = "auto"
    attention: Name = "auto"
    step_cache: Name = "auto"
    compile: Name = "auto"
    speed: Name = "default"
    steps: Annotated[int, Field(ge=1, le=1000)] | None = None
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None

    def request(self) -> InferenceRequest:
        return InferenceRequest(**self.model_dump(include=set(PlanControls.model_fields)))


class PlanBody(PlanControls):
    model: PathText | None = None
    family: Name | None = None
    checkpoint: Name | None = None
    base: PathText | None = None


class LoadBody(PlanControls):
    model: PathText
    family: Name | None = None
    base: PathText | None = None
    loras: Loras = Field(default_factory=list)
    #: LoRAs will be switched on the loaded pipeline (keeps them unfused).
    lora_switching: bool = False


class GenerateBody(Body):
    prompt: Prompt
    negative_prompt: Prompt | None = None
    steps: Steps | None = None
    guidance: Annotated[float, Field(ge=0, le=50, allow_inf_nan=False)] | None = None
    width: Side | None = None
    height: Side | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    count: Count = 1
    #: Replace the loaded pipeline's LoRAs (``[]`` removes them; omitted keeps them).
    loras: Loras | None = None


class OpenAIImagesBody(BaseModel):
    """The OpenAI images API request; unknown fields are ignored as OpenAI does,
    the known ones are held to the same limits as the native body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: Prompt
    n: Count = 1
    size: Annotated[str, Field(pattern=r"^\d{1,5}x\d{1,5}$")] | None = "1024x1024"
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: Annotated[str, Field(max_length=4096)] | None = None
    #: An extension: LoRAs to generate with, as for ``/v1/images/generate``.
    loras: Loras | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @field_validator("size")
    @classmethod
    def _size_within_limits(cls, size: str | None) -> str | None:
        if size is not None:
            try:
                for side in size.split("x"):
                    _SIDE.validate_python(int(side))
            except ValidationError:
                raise ValueError(
                    f"size {size}: width and height must be multiples of {SIDE_MULTIPLE} "
                    f"from {MIN_SIDE} to {MAX_SIDE}"
                ) from None
        return size

    def dimensions(self) -> tuple[int | None, int | None]:
        if self.size is None:
            return None, None
        width, height = (int(side) for side in self.size.split("x"))
        return width, height


class StopBody(Body):
    save: bool = True


# -- training -----------------------------------------------------------------------


class TrainingStartBody(TrainingConfig):
    """:class:`TrainingConfig` as a strict HTTP body: the config's own fields
    and bounds, with JSON strings and arrays accepted where it holds a path or
    a tuple (strict mode would want Python objects there)."""

    model_config = ConfigDict(**TrainingConfig.model_config, strict=True)

    dataset_dir: Annotated[Path, Strict(False)] = _CONFIG_FIELDS["dataset_dir"]
    output_dir: Annotated[Path | None, Strict(False)] = _CONFIG_FIELDS["output_dir"]
    lora_targets: Annotated[tuple[str, ...] | None, Strict(False)] = _CONFIG_FIELDS["lora_targets"]

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    def config(self, **update: object) -> TrainingConfig:
        """The plain config (what the engine and the trainer child hold), with ``update`` applied."""
        return TrainingConfig.model_validate({**self.model_dump(), **update})
