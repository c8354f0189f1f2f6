"""Engine generate vs plain diffusers on the same tiny pipeline, steady state.

Like for like: both sides load the same folder, run the same prompt, steps,
size and seed, with the same torch thread count, the step cache off and the
engine's prompt cache off (diffusers has none: it reruns the text encoders
every call), so both do the same work; the calls alternate, after warm-up,
and the medians are compared. Target: engine / diffusers <= 1.03. The
engine with its prompt cache on (the default: a repeated prompt skips the
encoders) is printed beside it, as what a user gets, not as the comparison.

    .venv/bin/python bench/generate_overhead.py [--families flux sdxl wan] [--runs 9] [--steps 8] [--frames 9]

A video family (``wan``) renders a clip of ``--frames`` frames on both sides: plain
``WanPipeline`` with ``num_frames`` and PIL frames out, the engine through the same call
its ``engine.videos`` makes (the lattice checked, the VAE tiled: at 64 px no tile engages).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402

from engine.hardware.probe import probe  # noqa: E402
from engine.contract.plugins import load_registry  # noqa: E402
from engine.policy.inference import InferenceRequest, plan_inference  # noqa: E402
from engine.preflight.model import resolve_model  # noqa: E402
from engine.runtime.session import GenerateRequest, InferenceSession  # noqa: E402
from engine.testing.stock import stock_dtypes  # noqa: E402

PROMPT = "a lighthouse at dusk"


def timed(call) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def session(registry, folder: Path, *, prompt_cache: bool) -> InferenceSession:  # type: ignore[no-untyped-def]
    request = InferenceRequest(step_cache="off", threads=torch.get_num_threads(), prompt_cache=prompt_cache)
    source = resolve_model(registry, folder)
    plan = plan_inference(registry, source.facts(registry), probe(verify=False), request)
    loaded = InferenceSession(registry, source, plan, request)
    loaded.load()
    return loaded


def bench_family(registry, family: str, folder: Path, runs: int, steps: int, size: int,  # type: ignore[no-untyped-def]
                 frames: int = 9) -> tuple[float, float, float]:
    engine = session(registry, folder, prompt_cache=False)
    cached = session(registry, folder, prompt_cache=True)
    source = engine.source
    spec = registry.family(family)
    # like for like: plain diffusers in the dtypes the engine's plan loads (bf16 where the CPU
    # multiplies it natively, a video VAE kept fp32), not the fp32 it once compared against
    plain = DiffusionPipeline.from_pretrained(folder, dtype=stock_dtypes(folder, spec, engine.plan))
    plain.set_progress_bar_config(disable=True)
    guidance = (source.checkpoint or spec.default_checkpoint).default_guidance
    extra = {"negative_prompt": " "} if spec.pipeline.guidance_kwarg == "true_cfg_scale" and guidance > 1 else {}
    clip = {"frames": frames} if spec.rendering.output == "frames" else {}
    if clip:
        extra = {**extra, "num_frames": frames, "output_type": "pil"}

    def run_plain() -> None:
        with torch.inference_mode():
            plain(PROMPT, num_inference_steps=steps, width=size, height=size,
                  generator=torch.Generator("cpu").manual_seed(0), **{spec.pipeline.guidance_kwarg: guidance}, **extra)

    def run_engine() -> None:
        engine.generate(GenerateRequest(PROMPT, steps=steps, width=size, height=size, seed=0, **clip))

    def run_cached() -> None:
        cached.generate(GenerateRequest(PROMPT, steps=steps, width=size, height=size, seed=0, **clip))

    for _ in range(2):  # warm-up
        run_plain(), run_engine(), run_cached()
    plain_s, engine_s, cached_s = [], [], []
    for _ in range(runs):
        plain_s.append(timed(run_plain))
        engine_s.append(timed(run_engine))
        cached_s.append(timed(run_cached))
    engine.unload()
    cached.unload()
    return statistics.median(engine_s), statistics.median(plain_s), statistics.median(cached_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["flux", "qwen_image", "zimage", "sdxl", "wan"])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=9, help="a video family's clip (on its lattice)")
    args = parser.parse_args()
    diffusers_logging.set_verbosity_error()
    registry = load_registry()
    print(f"{'family':<12} {'engine s':>9} {'diffusers s':>12} {'ratio':>7} {'cache on s':>11} {'ratio':>7}   "
          f"({args.steps} steps, {args.size}px, median of {args.runs}, {torch.get_num_threads()} threads; "
          "the first ratio is like for like, prompt cache off)")
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            folder = registry.build_tiny_pipeline(registry.family(family), Path(scratch) / family)
            engine_s, plain_s, cached_s = bench_family(registry, family, folder, args.runs, args.steps, args.size,
                                                      args.frames)
            print(f"{family:<12} {engine_s:>9.4f} {plain_s:>12.4f} {engine_s / plain_s:>7.3f} "
                  f"{cached_s:>11.4f} {cached_s / plain_s:>7.3f}")


if __name__ == "__main__":
    main()
