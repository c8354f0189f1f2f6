"""Request bodies: strict JSON types, bounded sizes, one definition of the limits.

The shared models and limits live in :mod:`engine.requests` (the CLI
validates with them too; the routes import them from there); this module
adds the HTTP-only bodies. Every body
is strict (``true`` is not a step count, ``"3"`` is not an int),
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

from engine.requests import (
    MAX_SIDE,
    MIN_SIDE,
    SIDE_MULTIPLE,
    Body,
    Count,
    KeepAliveSeconds,
    Loras,
    Prompt,
    Side,
    TrainingConfig,
    refuse_lone_surrogates,
)

_SIDE = TypeAdapter(Side)
_CONFIG_FIELDS = TrainingConfig.model_fields


class OpenAIImagesBody(BaseModel):
    """The OpenAI images API request; unknown fields are ignored as OpenAI does,
    the known ones are held to the same limits as the native body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: Prompt
    n: Count = 1
    #: ``WIDTHxHEIGHT``, or ``auto``: the model's own default size (as OpenAI's ``auto``).
    size: Annotated[str, Field(pattern=r"^(\d{1,5}x\d{1,5}|auto)$")] | None = "1024x1024"
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: Annotated[str, Field(max_length=4096)] | None = None
    #: An extension: LoRAs to generate with, as for ``/v1/images/generate``.
    loras: Loras | None = None
    #: An extension, as Ollama's: seconds the model stays loaded after this call.
    keep_alive: KeepAliveSeconds | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @field_validator("size")
    @classmethod
    def _size_within_limits(cls, size: str | None) -> str | None:
        if size is not None and size != "auto":
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
        """(width, height); (None, None) for ``auto``: the loaded model's default size."""
        if self.size is None or self.size == "auto":
            return None, None
        width, height = (int(side) for side in self.size.split("x"))
        return width, height


class StopBody(Body):
    #: Save the LoRA after the current step (false: stop without saving).
    save: bool = True
    #: Stop at once, discarding the partial step; the last checkpoint is kept.
    now: bool = False


# -- training -----------------------------------------------------------------------


class TrainingStartBody(TrainingConfig):
    """:class:`TrainingConfig` as a strict HTTP body: the config's own fields
    and bounds, with JSON strings and arrays accepted where it holds a path or
    a tuple (strict mode would want Python objects there)."""

    model_config = ConfigDict(**TrainingConfig.model_config, strict=True)

    dataset_dir: Annotated[Path, Strict(False)] = _CONFIG_FIELDS["dataset_dir"]
    output_dir: Annotated[Path | None, Strict(False)] = _CONFIG_FIELDS["output_dir"]
    lora_targets: Annotated[tuple[str, ...] | None, Strict(False)] = _CONFIG_FIELDS["lora_targets"]
    sample_prompts: Annotated[tuple[str, ...] | None, Strict(False)] = _CONFIG_FIELDS["sample_prompts"]
    resume_from: Annotated[Path | None, Strict(False)] = _CONFIG_FIELDS["resume_from"]
    #: A finished run of the server's runs folder to continue (its id, as ``GET /v1/training/runs``
    #: lists it): it keeps its id and folder and resumes from its newest checkpoint (or ``resume_from``).
    resume: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*$", max_length=200)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    def config(self, **update: object) -> TrainingConfig:
        """The plain config (what the engine and the trainer child hold), with ``update`` applied."""
        return TrainingConfig.model_validate({**self.model_dump(exclude={"resume"}), **update})
