"""Same-seed drift of the weight schemes against dense: int8 beside ConvRot int8.

Two measurements, both on this machine's torchao paths (weight-only int8 on the CPU):

1. **A Linear at FLUX.1's width** (3072 -> 3072, bf16-range weights drawn normal, with the
   outlier input channels DiT weights carry: 1% of the columns scaled 20x): the relative error
   of its output, per scheme, over the same inputs. This is what ConvRot's rotation is for: a
   per-row int8 scale is set by the row's largest weight, so an outlier column costs every
   other weight of the row its precision; rotated, the outlier's magnitude is spread across
   its group first.
2. **The tiny FLUX.1 pipeline** (random weights, no outliers): the mean absolute pixel change
   of a 64x64 image against dense, same seed, per scheme, through the engine's load.

    .venv/bin/python bench/scheme_drift.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

SCHEMES = ("int8", "int8_convrot")


def layer_drift(width: int = 3072, outliers: float = 0.01, scale: float = 20.0, seed: int = 0) -> dict[str, float]:
    """Relative output error of one ``width``-wide Linear per scheme."""
    from engine.runtime import quantize

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(width, width, generator=generator) * width**-0.5
    columns = torch.randperm(width, generator=generator)[: int(width * outliers)]
    weight[:, columns] *= scale
    inputs = torch.randn(256, width, generator=generator)
    dense = torch.nn.Linear(width, width, bias=False)
    dense.weight.data.copy_(weight)
    reference = dense(inputs)
    errors = {}
    for scheme in SCHEMES:
        layer = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False))
        layer[0].weight.data.copy_(weight)
        quantize.quantize_transformer(layer, scheme, "cpu")
        with torch.no_grad():
            errors[scheme] = float((layer(inputs) - reference).norm() / reference.norm())
    return errors


def pipeline_drift() -> dict[str, float]:
    """Mean absolute pixel change against dense of the tiny FLUX.1's image, per scheme."""
    from engine.contract.plugins import load_registry
    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine

    registry = load_registry()
    with tempfile.TemporaryDirectory() as folder:
        base = registry.build_tiny_pipeline(registry.family("flux"), Path(folder) / "flux", None)
        images = {}
        with Engine(registry=registry) as engine:
            for scheme in ("none", *SCHEMES):
                engine.images.load(str(base), request=InferenceRequest(quant=scheme))
                image = engine.images.generate("a red fox", width=64, height=64, steps=4, seed=3)[0]
                images[scheme] = np.asarray(image).astype(float)
    return {scheme: float(np.abs(images[scheme] - images["none"]).mean()) for scheme in SCHEMES}


def main() -> None:
    layer = layer_drift()
    print("Linear 3072x3072, 1% outlier columns x20: relative output error against dense")
    for scheme, error in layer.items():
        print(f"  {scheme:13s} {error:.5f}")
    print(f"  ratio int8_convrot / int8: {layer['int8_convrot'] / layer['int8']:.3f}")
    plain = layer_drift(outliers=0.0)
    print("Same Linear without outliers:", ", ".join(f"{s} {e:.5f}" for s, e in plain.items()))
    print("tiny FLUX.1, 64x64, 4 steps: mean |pixel change| against dense (0-255)")
    for scheme, drift in pipeline_drift().items():
        print(f"  {scheme:13s} {drift:.3f}")


if __name__ == "__main__":
    sys.exit(main())
