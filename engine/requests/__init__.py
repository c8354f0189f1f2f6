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

from typing import TYPE_CHECKING, Any

from engine.places import default_datasets_dir, default_runs_dir

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



if TYPE_CHECKING:  # imported when first used (pydantic's models cost a light command its start)
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
    from engine.requests.training import InvalidConfig, LossWeighting, Optimizer, TrainingConfig, read_config_file

#: Names whose modules load on first use: the pydantic request models and the training config.
_LAZY: dict[str, str] = {
    "MAX_COUNT": "engine.requests.bodies",
    "MAX_LORAS": "engine.requests.bodies",
    "MAX_PLAN_STEPS": "engine.requests.bodies",
    "MAX_SEED": "engine.requests.bodies",
    "MAX_SIDE": "engine.requests.bodies",
    "MAX_STEPS": "engine.requests.bodies",
    "MIN_SIDE": "engine.requests.bodies",
    "PLAN_FIELDS": "engine.requests.bodies",
    "SIDE_MULTIPLE": "engine.requests.bodies",
    "Body": "engine.requests.bodies",
    "Count": "engine.requests.bodies",
    "GenerateBody": "engine.requests.bodies",
    "KeepAliveSeconds": "engine.requests.bodies",
    "Guidance": "engine.requests.bodies",
    "LoadBody": "engine.requests.bodies",
    "LoraBody": "engine.requests.bodies",
    "Loras": "engine.requests.bodies",
    "Name": "engine.requests.bodies",
    "PathText": "engine.requests.bodies",
    "PlanBody": "engine.requests.bodies",
    "PlanControls": "engine.requests.bodies",
    "Prompt": "engine.requests.bodies",
    "Seed": "engine.requests.bodies",
    "Side": "engine.requests.bodies",
    "Steps": "engine.requests.bodies",
    "describe_problems": "engine.requests.bodies",
    "lora_bodies": "engine.requests.bodies",
    "refuse_lone_surrogates": "engine.requests.bodies",
    "InvalidConfig": "engine.requests.training",
    "LossWeighting": "engine.requests.training",
    "Optimizer": "engine.requests.training",
    "TrainingConfig": "engine.requests.training",
    "read_config_file": "engine.requests.training",
}


def __getattr__(name: str) -> Any:
    """A request model, imported the first time it is asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
