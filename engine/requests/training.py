"""The training request (:class:`TrainingConfig`), validated at the edge.

Values from a dict (an HTTP body, a JSON file) are coerced to their types
before any arithmetic (``"3"`` epochs is 3); what cannot be coerced is
refused naming the field. It is the request vocabulary's; the trainer and the
preflight import it from here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.errors import EngineError


class InvalidConfig(EngineError):
    code = "invalid_config"


#: Upper bounds that keep every numeric field inside what the trainer, torch
#: and a GPU can honour; a value past one is refused before anything is freed.
MAX_STEPS = 1_000_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; JSON clients stay signed
MAX_RANK = 1024
MAX_BATCH = 64
MAX_GPUS = 64
MAX_NODES = 1024
#: Seconds every rank of a multi-node run waits for the others before the run fails.
JOIN_TIMEOUT_S = 600.0


#: Per-timestep loss weights (the trainer's levers: :mod:`engine.training.levers`).
LossWeighting = Literal["none", "min_snr", "bell"]
#: The optimizers a run may ask for (8-bit AdamW needs CUDA and bitsandbytes).
Optimizer = Literal["adamw", "adamw8bit", "adafactor"]


class TrainingConfig(BaseModel):
    """One LoRA training run. ``None`` means the family's default.

    Every numeric field has both bounds: an unbounded one (a rank of 10**10,
    a seed of 2**70) would pass here and fail only after the GPU was taken.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    base_model: str = Field(..., min_length=1, max_length=4096)
    family: str | None = Field(None, min_length=1, max_length=128)
    dataset_dir: Path
    output_dir: Path | None = None
    resolution: int = Field(512, ge=64, le=4096, multiple_of=16)
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    epochs: int | None = Field(None, ge=1, le=100_000)
    batch_size: int = Field(1, ge=1, le=MAX_BATCH)
    grad_accumulation: int = Field(1, ge=1, le=1024)
    #: None: the family's default (its table), else 1e-4.
    learning_rate: float | None = Field(None, gt=0, le=1.0)
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    #: None: the family's default; with ``constant`` a warmup ramps up first.
    warmup_steps: int | None = Field(None, ge=0, le=MAX_STEPS)
    #: Flow-matching sigma shift: a number, ``auto`` (by resolution), None: the family's.
    flow_shift: Annotated[float, Field(gt=0, le=100)] | Literal["auto"] | None = None
    loss_weighting: LossWeighting = "none"
    #: Decay of an EMA of the LoRA, saved as a second adapter; None: no EMA.
    ema_decay: float | None = Field(None, gt=0, lt=1)
    optimizer: Optimizer = "adamw"
    #: Reuse caption embeddings across runs on the same data and base.
    prompt_cache: bool = True
    #: Where they are kept (None: $DIFFUSION_ENGINE_PROMPT_CACHE or the user's cache folder).
    prompt_cache_dir: Path | None = None
    lora_rank: int = Field(16, ge=1, le=MAX_RANK)
    lora_alpha: float | None = Field(None, gt=0, le=65536)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: tuple[str, ...] | None = Field(None, min_length=1, max_length=256)
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    #: ``auto`` by design (the earlier system defaulted to nf4): auto sizes the
    #: run and picks nf4 wherever bf16 / int8 would not fit, memory is unknown
    #: or there is no CUDA, and the 2.3x faster bf16 where it fits.
    base_precision: str = Field("auto", max_length=32)
    compile: Literal["auto", "on", "off"] = "auto"
    #: None: the engine decides (off when the run fits without it, else on).
    gradient_checkpointing: bool | None = None
    device: Literal["auto", "cuda", "cpu"] = "auto"
    #: Processes (ranks) the run trains on, one device each; above 1 the trainer
    #: runs under accelerate (DDP) and ``batch_size`` is per rank. With
    #: ``device=cpu``: that many CPU processes (gloo).
    gpus: int = Field(1, ge=1, le=MAX_GPUS)
    #: Machines the run spans (``train --nodes``): each runs this same config with its own
    #: ``node_rank`` and ``gpus`` ranks; rank 0 (node 0's first) writes the run.
    nodes: int = Field(1, ge=1, le=MAX_NODES)
    node_rank: int = Field(0, ge=0, lt=MAX_NODES)
    #: ``HOST:PORT`` of node 0, where the ranks meet (torch's rendezvous); needed with ``nodes`` > 1.
    main_address: str | None = Field(None, max_length=300)
    #: Seconds every rank waits for the others to join (the other machines to start) before
    #: the run fails with ``nodes_not_joined``.
    join_timeout: float = Field(JOIN_TIMEOUT_S, gt=0, le=86_400)
    export_kohya: bool = False
    #: Points kept per metric in the run record (older points are thinned).
    metric_history: int = Field(500, ge=10, le=100_000)
    #: Write a checkpoint (LoRA, optimizer, scheduler, RNG, step) every N steps; None: never.
    save_every: int | None = Field(None, ge=1, le=MAX_STEPS)
    #: Checkpoints kept (the newest); older ones are deleted as new ones land.
    keep_checkpoints: int = Field(3, ge=1, le=1000)
    #: A checkpoint folder to continue from (set by ``train --resume``).
    resume_from: Path | None = None
    #: Prompts rendered with the current LoRA every ``sample_every`` steps (fixed seeds: seed + index).
    sample_prompts: tuple[str, ...] | None = Field(None, min_length=1, max_length=16)
    sample_every: int | None = Field(None, ge=1, le=MAX_STEPS)
    #: Denoising steps per sample image.
    sample_steps: int = Field(20, ge=1, le=200)
    #: A word put before every caption (``"ohwx, a red circle"``): what a prompt uses to call up the LoRA.
    trigger_word: str | None = Field(None, min_length=1, max_length=200)
    #: The share of samples trained with the empty prompt instead of their caption.
    caption_dropout: float = Field(0.0, ge=0, lt=1)
    #: Shuffle each caption's comma-separated tags (the trainer caches a few shuffles per caption).
    shuffle_tags: bool = False
    #: With ``shuffle_tags``: the first N tags stay in place.
    keep_tags: int = Field(0, ge=0, le=1000)
    #: Refuse (instead of warn about) images under half the training resolution.
    strict: bool = False
    #: Frames of each training clip (a video family; on its VAE's lattice, e.g. 4k+1), sampled at the
    #: family's fps; None: the family's. Images train as one-frame clips.
    frames: int | None = Field(None, ge=1, le=1024)
    #: A clip shorter than the window: refused (named), or padded by holding its last frame.
    short_clips: Literal["refuse", "pad"] = "refuse"
    #: Which expert of a two-expert base trains: ``high`` (the high-noise steps),
    #: ``low``, or ``both`` (each on its own timesteps, two LoRA files); None: both.
    expert: Literal["high", "low", "both"] | None = None

    @field_validator("base_model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty; give a local pipeline folder (or a hub repo id where allowed)")
        if "\x00" in value:
            raise ValueError("contains a NUL byte")
        return value

    @field_validator("lora_targets")
    @classmethod
    def _targets_named(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and any(not t.strip() or len(t) > 256 for t in value):
            raise ValueError("every LoRA target is a non-empty module name (to_q, attn.to_out.0)")
        return value

    @field_validator("trigger_word")
    @classmethod
    def _trigger_is_a_word(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value != value.strip() or "\x00" in value or "\n" in value):
            raise ValueError("is a word or short phrase on one line, with no leading or trailing spaces")
        return value

    @field_validator("sample_prompts")
    @classmethod
    def _prompts_bounded(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and any(len(p) > 2000 or "\x00" in p for p in value):
            raise ValueError("every sample prompt is at most 2000 characters, with no NUL byte")
        return value

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.sample_every is not None and not self.sample_prompts:
            raise ValueError("sample_every needs at least one sample prompt")
        if self.nodes > 1:
            if not self.main_address or not re.fullmatch(r"[^\s:]+:\d{1,5}", self.main_address):
                raise ValueError("nodes > 1 needs main_address HOST:PORT: node 0's address, where the ranks meet")
            port = int(self.main_address.rsplit(":", 1)[1])
            if not 1 <= port <= 65535:
                raise ValueError(f"main_address's port {port} is not a TCP port (1-65535)")
            if self.node_rank >= self.nodes:
                raise ValueError(f"node_rank {self.node_rank} is not below nodes {self.nodes} (ranks are 0-based)")
        elif self.node_rank:
            raise ValueError("node_rank applies only with nodes > 1")
        if self.keep_tags and not self.shuffle_tags:
            raise ValueError("keep_tags applies only with shuffle_tags (it keeps the first N tags in place)")
        return self

    def total_steps(self, images: int) -> int:
        """Optimizer steps: ``steps``, or ``epochs`` over ``images`` images; 500 when neither is given."""
        if self.steps is not None:
            return self.steps
        if self.epochs is None:
            return 500
        per_step = self.batch_size * self.grad_accumulation * self.world  # the global batch
        return max(1, math.ceil(self.epochs * images / per_step))

    @property
    def world(self) -> int:
        """Ranks in the run, over every node."""
        return self.gpus * self.nodes

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


def read_config_file(path: Path) -> dict[str, object]:
    """The fields in a TOML (or ``.json``) config file; validated later with the flags merged in.

    :raises InvalidConfig: the file is missing, unreadable or not a table of fields.
    """
    import json

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
        tomllib = None  # type: ignore[assignment]
    as_json = Path(path).suffix.lower() == ".json"
    if tomllib is None and not as_json:
        raise InvalidConfig(f"reading {path} needs Python 3.11+ (tomllib); give a .json config instead")
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if as_json else tomllib.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"cannot read the config file {path}: {exc}; give a readable TOML file") from None
    except RecursionError:
        raise InvalidConfig(f"the config file {path} nests too deep to be a table of fields") from None
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise InvalidConfig(f"the config file {path} is not valid TOML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidConfig(f"the config file {path} must hold a table of TrainingConfig fields")
    return data


__all__ = [
    "JOIN_TIMEOUT_S", "MAX_BATCH", "MAX_GPUS", "MAX_NODES", "MAX_RANK", "MAX_SEED", "MAX_STEPS", "InvalidConfig",
    "LossWeighting", "Optimizer", "TrainingConfig", "read_config_file",
]
