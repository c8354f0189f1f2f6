"""The request vocabulary: every record a face builds and :class:`engine.Engine` takes.

- :mod:`engine.requests.controls`: the table of controls (field, flag,
  default, choices, help, plan key), from which the CLI's flags, the request
  models' plan fields, the docs' tables and a refusal's words come;
- :mod:`engine.requests.bodies`: the strict request models (plan, load,
  generate with its image inputs and LoRAs) and their shared limits;
- :mod:`engine.requests.choices`: what each control may be set to;
- :mod:`engine.requests.inference`: the inference request the policy decides from;
- :mod:`engine.requests.loras` and :mod:`engine.requests.references`: how a
  request names a LoRA, a model, a run's files (syntax only);
- :mod:`engine.requests.training`: the training run's config;
- :mod:`engine.requests.machine`: the machine a request is decided for.

A leaf over the plugin contract: it imports no policy, preflight, runtime or
trainer module (``tests/house/test_layers.py``); those import their records from here.

The CLI and the HTTP server import the engine only through this package,
:mod:`engine.errors` and the facade (:class:`engine.Engine`), so one request
means one thing whichever door it came in by.
"""

from __future__ import annotations

from engine.places import default_datasets_dir, default_runs_dir

from engine.requests.bodies import (
    MAX_COUNT,
    MAX_LORAS,
    MAX_PLAN_STEPS,
    MAX_SEED,
    MAX_SIDE,
    MAX_STEPS,
    MIN_SIDE,
    PLAN_FIELDS,
    SIDE_MULTIPLE,
    Body,
    Count,
    GenerateBody,
    KeepAliveSeconds,
    Guidance,
    LoadBody,
    LoraBody,
    Loras,
    Name,
    PathText,
    PlanBody,
    PlanControls,
    Prompt,
    Seed,
    Side,
    Steps,
    describe_problems,
    lora_bodies,
    refuse_lone_surrogates,
)
from engine.requests.controls import (
    ALL_CONTROLS,
    FIELD_FLAGS,
    GENERATE_CONTROLS,
    MODEL_CONTROLS,
    PLAN_CONTROLS,
    PLAN_KEY_FLAGS,
    TRAIN_CONTROLS,
    Control,
    in_flag_words,
    markdown_table,
)
from engine.requests.machine import MachineRequest
from engine.requests.inference import InferenceRequest, LoraPlanInput
from engine.requests.loras import LoraChoice, LoraLike, lora_choices, parse_lora_arg
from engine.requests.references import (
    ALLOW_DOWNLOAD_ENV,
    CLIP_EXTENSIONS,
    IMAGE_EXTENSIONS,
    RUN_ADAPTER_FILES,
    download_allowed,
    download_allowed_by_env,
    is_hub_id,
    looks_like_path,
)
from engine.requests.training import InvalidConfig, LossWeighting, Optimizer, TrainingConfig, read_config_file



__all__ = [
    "KeepAliveSeconds",
    "ALLOW_DOWNLOAD_ENV", "default_datasets_dir", "ALL_CONTROLS", "CLIP_EXTENSIONS", "IMAGE_EXTENSIONS", "RUN_ADAPTER_FILES", "is_hub_id", "looks_like_path", "Body", "Control", "Count", "FIELD_FLAGS", "GENERATE_CONTROLS",
    "GenerateBody", "Guidance", "InferenceRequest", "InvalidConfig", "LoraChoice", "LoraLike", "LoraPlanInput", "LoadBody", "LoraBody", "Loras", "LossWeighting",
    "MAX_COUNT", "MAX_LORAS", "MAX_PLAN_STEPS", "MAX_SEED", "MAX_SIDE", "MAX_STEPS", "MIN_SIDE",
    "MODEL_CONTROLS", "MachineRequest", "Name", "Optimizer", "PLAN_CONTROLS", "PLAN_FIELDS", "PLAN_KEY_FLAGS",
    "PathText", "PlanBody", "PlanControls", "Prompt", "SIDE_MULTIPLE", "Seed", "Side", "Steps",
    "TRAIN_CONTROLS", "TrainingConfig", "default_runs_dir", "describe_problems", "download_allowed",
    "download_allowed_by_env", "in_flag_words", "lora_bodies", "lora_choices", "parse_lora_arg", "markdown_table", "read_config_file", "refuse_lone_surrogates",
]
