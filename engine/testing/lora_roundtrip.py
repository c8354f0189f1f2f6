"""A family's LoRA, trained on a tiny pipeline and applied back: the check its suite runs.

Four steps on two images with the kohya export ComfyUI reads (``export_kohya``); then, through
the engine, the LoRA moves the image, scale 0 is the base's (within a level: a pipeline with any
adapter loaded is a level off its own base), and the kohya file gives the trained LoRA's image.
Returns the export's module names, for a family's own check of how they are spelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def train_and_reload(registry: Any, folder: Path, workdir: Path, *, prompt: str = "a red fox") -> set[str]:
    """Train, export and reload a tiny LoRA of the pipeline at ``folder`` (see the module doc);
    raises AssertionError where any image is not as promised."""
    from safetensors.torch import load_file

    from engine.hardware.probe import probe
    from engine.requests.training import TrainingConfig
    from engine.service.facade import Engine
    from engine.testing.datasets import write_dataset
    from engine.training.preflight import preflight_training
    from engine.training.trainer import run_training

    data = write_dataset(workdir / "data", count=2, size=64)
    config = TrainingConfig.from_data({"base_model": str(folder), "dataset_dir": str(data), "resolution": 64,
                                       "steps": 4, "lora_rank": 4, "learning_rate": 5e-2, "device": "cpu", "seed": 1,
                                       "export_kohya": True})
    plan = preflight_training(registry, config, probe(verify=False))
    end = run_training(plan, workdir / "run", lambda _event: None, lambda: None, registry=registry)
    assert end["type"] == "completed", end
    lora, kohya = workdir / "run" / "pytorch_lora_weights.safetensors", workdir / "run" / "lora_kohya.safetensors"
    with Engine(registry=registry, hardware=probe(verify=False)) as engine:
        engine.images.load(str(folder))
        images = [engine.images.generate(prompt, loras=loras, width=64, height=64, steps=2, seed=5)[0]
                  for loras in ([], [f"{lora}:1.0"], [f"{lora}:0.0"], [f"{kohya}:1.0"])]
    base, moved, zero, comfy = (np.asarray(image).astype(int) for image in images)
    assert np.abs(moved - base).max() > 8, "the LoRA did not move the image"
    assert np.abs(zero - base).max() <= 1, "at scale 0 the image is not the base's"
    assert np.abs(comfy - moved).max() <= 1, "the kohya export does not give the trained LoRA's image"
    return {key.split(".")[0] for key in load_file(str(kohya))}
