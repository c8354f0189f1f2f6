"""Planner accuracy: predicted vs measured bytes of each family's denoiser, bf16 and int8.

Each family's denoiser is built at its real widths with fewer blocks (a
"reduced config": the real layer shapes, at a size this machine holds) and
saved as safetensors. Predicted bytes are what the engine plans with, read
torch-free from that file's header (engine.preflight.headers: parameter count
for bf16; the int8 module filter applied to tensor names and shapes for
int8). Measured bytes are the real tensors after loading in bf16 and after
the engine's own int8 quantisation. Target: error <= 5%.

``--factors`` prints each family's steady factor per scheme at full size
(config on the meta device, no weights), through the engine's factor tool
(:mod:`engine.testing.quant_factors`, which also reads a checkpoint's headers
and checks a table: ``python -m engine.testing.quant_factors --family F --check``). It works for every installed family, a
third-party plugin's too: the built-ins' full-size configs are below; any
other family's denoiser config is read from ``--config FAMILY=DIR`` (a
pipeline folder with ``model_index.json`` and ``<denoiser>/config.json``, or
the denoiser's own folder: config files only, no weights), else from the
hub cache of its default checkpoint (offline).

    .venv/bin/python bench/planner_accuracy.py [--families flux zimage] [--factors]
    .venv/bin/python bench/planner_accuracy.py --factors --families sd3 --config sd3=~/sd3.5-configs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.contract.plugins import load_registry
from engine.policy.quant_filter import LAYOUTS, dense_gb
from engine.testing.quant_factors import factors_of
from engine.preflight.headers import sizes_by_scheme, tensor_shapes
from engine.runtime.quantize import quantize_transformer, storage_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_configs import SDXL_UNET  # noqa: E402  (bench/ is not a package)

#: family -> (diffusers class, full-size config, reduced overrides)
MODELS = {
    "flux": ("FluxTransformer2DModel", dict(guidance_embeds=True), dict(num_layers=1, num_single_layers=2)),
    "qwen_image": ("QwenImageTransformer2DModel", {}, dict(num_layers=2)),
    "zimage": ("ZImageTransformer2DModel", {}, dict(n_layers=2, n_refiner_layers=1)),
    "sdxl": ("UNet2DConditionModel", SDXL_UNET, dict(transformer_layers_per_block=(1, 2, 2))),
}


def model_class(family: str):  # type: ignore[no-untyped-def]
    import diffusers

    return getattr(diffusers, MODELS[family][0])


def full_size_model(family: str, configs: dict[str, Path]) -> torch.nn.Module:
    """The family's full-size denoiser on the meta device (no weights)."""
    import diffusers

    if family in MODELS and family not in configs:
        _, full, _ = MODELS[family]
        with torch.device("meta"):
            return model_class(family).from_config(full)
    spec = load_registry().family(family)
    root = configs.get(family)
    if root is None:  # the default checkpoint's configs from the hub cache, offline
        index = diffusers.DiffusionPipeline.load_config(spec.default_checkpoint.repo, local_files_only=True)
        cls = getattr(diffusers, index[spec.pipeline.denoiser][1])
        config = cls.load_config(spec.default_checkpoint.repo, subfolder=spec.pipeline.denoiser, local_files_only=True)
    elif (root / "model_index.json").exists():
        index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
        cls = getattr(diffusers, index[spec.pipeline.denoiser][1])
        config = cls.load_config(root / spec.pipeline.denoiser)
    else:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        return cls.from_config(config)


def full_size_factors(families: list[str], configs: dict[str, Path]) -> None:
    print(f"{'family':<11} {'params':>8}  " + "  ".join(f"{s:>6}" for s in LAYOUTS))
    for family in families:
        try:
            model = full_size_model(family, configs)
        except (OSError, KeyError, ValueError, AttributeError) as exc:
            print(f"{family:<11} no full-size config ({str(exc).splitlines()[0][:120]}); give "
                  f"--config {family}=DIR (model_index.json and the denoiser's config.json)")
            continue
        tensors = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        derived = factors_of(tensors, load_registry().family(family).quantisation.int8_dense_modules)
        factors = "  ".join(f"{derived.factors[s]:>6.3f}" for s in LAYOUTS)
        print(f"{family:<11} {derived.dense_gb / 2:>7.2f}B  {factors}   {derived.literal()}")


def accuracy(families: list[str]) -> None:
    print(f"{'family':<11} {'params':>8} {'bf16 pred GB':>12} {'meas':>7} {'err':>6}   "
          f"{'int8 pred GB':>12} {'meas':>7} {'err':>6}  quantised")
    for family in families:
        _, full, reduced = MODELS[family]
        started = time.perf_counter()
        torch.manual_seed(0)
        model = model_class(family).from_config({**full, **reduced}).to(torch.bfloat16)
        with tempfile.TemporaryDirectory() as scratch:
            model.save_pretrained(scratch)
            files = sorted(Path(scratch).glob("*.safetensors"))
            shapes = tensor_shapes(files)
            predicted_bf16 = dense_gb(shapes)
            predicted_int8 = sizes_by_scheme(shapes)["int8"]
        numel = sum(p.numel() for p in model.parameters())
        measured_bf16 = storage_bytes(model) / 1e9
        layers = quantize_transformer(model, "int8", "cpu")
        measured_int8 = storage_bytes(model) / 1e9
        err_bf16 = abs(predicted_bf16 - measured_bf16) / measured_bf16
        err_int8 = abs(predicted_int8 - measured_int8) / measured_int8
        print(f"{family:<11} {numel / 1e6:>7.0f}M {predicted_bf16:>12.3f} {measured_bf16:>7.3f} {err_bf16:>6.2%}   "
              f"{predicted_int8:>12.3f} {measured_int8:>7.3f} {err_int8:>6.2%}  {layers} Linears "
              f"({time.perf_counter() - started:.0f} s)")
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=None,
                        help="families to measure (default: the built-ins; with --factors, every installed family)")
    parser.add_argument("--factors", action="store_true", help="print full-size factors instead")
    parser.add_argument("--config", action="append", default=[], metavar="FAMILY=DIR",
                        help="a folder with a family's full-size configs (--factors; repeatable)")
    args = parser.parse_args()
    configs = {k: Path(v).expanduser() for k, _, v in (c.partition("=") for c in args.config)}
    if args.factors:
        full_size_factors(args.families or sorted(load_registry().families), configs)
    else:
        accuracy(args.families or list(MODELS))


if __name__ == "__main__":
    main()
