"""Engine generate vs plain diffusers on the same tiny pipeline, steady state.

Both sides load the same folder, run the same prompt, steps, size and seed,
with the same torch thread count and the step cache off (so both do the same
denoising work); the calls alternate, after warm-up, and the medians are
compared. Target: engine / diffusers <= 1.03.

    .venv/bin/python bench/generate_overhead.py [--families flux sdxl] [--runs 9] [--steps 8]
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
from engine.plugins import load_registry  # noqa: E402
from engine.policy.inference import InferenceRequest, plan_inference  # noqa: E402
from engine.preflight.model import resolve_model  # noqa: E402
from engine.runtime.session import GenerateRequest, InferenceSession  # noqa: E402

PROMPT = "a lighthouse at dusk"


def timed(call) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bench_family(registry, family: str, folder: Path, runs: int, steps: int, size: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    request = InferenceRequest(step_cache="off", threads=threads)
    source = resolve_model(registry, folder)
    plan = plan_inference(registry, source.facts(registry), probe(verify=False), request)
    engine = InferenceSession(registry, source, plan, request)
    engine.load()
    plain = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    plain.set_progress_bar_config(disable=True)
    spec = registry.family(family)
    guidance = (source.checkpoint or spec.default_checkpoint).default_guidance
    extra = {"negative_prompt": " "} if spec.guidance_kwarg == "true_cfg_scale" and guidance > 1 else {}

    def run_plain() -> None:
        with torch.inference_mode():
            plain(PROMPT, num_inference_steps=steps, width=size, height=size,
                  generator=torch.Generator("cpu").manual_seed(0), **{spec.guidance_kwarg: guidance}, **extra)

    def run_engine() -> None:
        engine.generate(GenerateRequest(PROMPT, steps=steps, width=size, height=size, seed=0))

    for _ in range(2):  # warm-up
        run_plain(), run_engine()
    plain_s, engine_s = [], []
    for _ in range(runs):
        plain_s.append(timed(run_plain))
        engine_s.append(timed(run_engine))
    engine.unload()
    return statistics.median(engine_s), statistics.median(plain_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["flux", "qwen_image", "zimage", "sdxl"])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    diffusers_logging.set_verbosity_error()
    registry = load_registry()
    print(f"{'family':<12} {'engine s':>9} {'diffusers s':>12} {'ratio':>7}   ({args.steps} steps, {args.size}px, median of {args.runs}, {torch.get_num_threads()} threads)")
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            folder = registry.build_tiny_pipeline(registry.family(family), Path(scratch) / family)
            engine_s, plain_s = bench_family(registry, family, folder, args.runs, args.steps, args.size)
            print(f"{family:<12} {engine_s:>9.4f} {plain_s:>12.4f} {engine_s / plain_s:>7.3f}")


if __name__ == "__main__":
    main()
