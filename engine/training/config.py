"""The training request, validated at the edge.

Values from a dict (an HTTP body, a JSON file) are coerced to their types
before any arithmetic (``"3"`` epochs is 3); what cannot be coerced is
refused naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import EngineError


class InvalidConfig(EngineError):
    code = "invalid_config"


class TrainingConfig(BaseModel):
    """One LoRA training run. ``None`` means the family's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_model: str
    family: str | None = None
    dataset_dir: Path
    output_dir: Path | None = None
    resolution: int = Field(512, ge=64, le=4096, multiple_of=16)
    steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(None, ge=1)
    batch_size: int = Field(1, ge=1)
    grad_accumulation: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float | None = Field(None, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: tuple[str, ...] | None = None
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 0
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    base_precision: str = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    gradient_checkpointing: bool = False
    device: Literal["auto", "cuda", "cpu"] = "auto"
    export_kohya: bool = False
    #: Points kept per metric in the run record (older points are thinned).
    metric_history: int = Field(500, ge=10)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        return self

    def total_steps(self, images: int) -> int:
        """Optimizer steps: ``steps``, or ``epochs`` over ``images`` images; 500 when neither is given."""
        if self.steps is not None:
            return self.steps
        if self.epochs is None:
            return 500
        per_step = self.batch_size * self.grad_accumulation
        return max(1, math.ceil(self.epochs * images / per_step))

    def public_dict(self) -> dict[str, object]:
        """The config for records and status: JSON-ready, nothing secret."""
        return self.model_dump(mode="json")

    @classmethod
    def from_data(cls, data: dict[str, object]) -> TrainingConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or 'config'}: {error['msg']}"
                for error in exc.errors()
            )
            raise InvalidConfig(f"invalid training config: {problems}") from None
