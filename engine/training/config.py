"""The resolved training config written back as TOML, beside the record the run keeps.

:class:`TrainingConfig` itself is the request vocabulary's
(:mod:`engine.requests.training`); its names are re-exported here for the
trainer's older imports.
"""

from __future__ import annotations

from engine.requests.training import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_NODES,
    MAX_RANK,
    MAX_SEED,
    MAX_STEPS,
    InvalidConfig,
    LossWeighting,
    Optimizer,
    TrainingConfig,
    read_config_file,
)


def config_toml(config: TrainingConfig) -> str:
    """The resolved config as TOML (unset fields left out), readable by :func:`read_config_file`.

    Floats are written with ``repr`` so the file reproduces the run bit for bit;
    ``output_dir`` and ``resume_from`` belong to this run and are left out.
    """
    import json

    def value(item: object) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, (int, float)):
            return repr(item)
        if isinstance(item, (list, tuple)):
            return "[" + ", ".join(value(v) for v in item) + "]"
        return json.dumps(str(item), ensure_ascii=False)

    lines = ["# A resolved TrainingConfig: `diffusion-engine train --config THIS_FILE` repeats the run."]
    this_run_only = {"output_dir", "resume_from"}  # a repeat writes a new folder and starts afresh
    lines += [f"{key} = {value(item)}" for key, item in config.public_dict().items()
              if item is not None and key not in this_run_only]
    return "\n".join(lines) + "\n"


__all__ = [
    "MAX_BATCH", "MAX_GPUS", "MAX_NODES", "MAX_RANK", "MAX_SEED", "MAX_STEPS", "InvalidConfig", "LossWeighting",
    "Optimizer", "TrainingConfig", "config_toml", "read_config_file",
]
