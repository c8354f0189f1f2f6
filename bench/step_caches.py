"""Step caches side by side on the same tiny pipeline: speed and drift against no cache.

Each cache (``off``, ``fbcache``, ``taylorseer``, ``magcache`` where the checkpoint names
its ratios, ``seacache`` where the pipeline hands it the schedule: Wan's; one the plan does
not offer is named, not timed) renders the same prompt, seed and steps through the engine's
own session; the caches alternate call by call after a warm-up call each, and medians are
compared. Drift is the mean absolute difference from the uncached
image, in 8-bit levels (a clip's every frame), at the same seed. Where cache-dit is installed
(``pip install cache-dit``: not one of the engine's dependencies), its DBCache joins them:
an uncached session's pipeline handed to ``cache_dit.enable_cache`` with the engine's
First-Block-Cache settings (the first block computed, the residual threshold 0.08, no
blocks after), so the two implementations of the same idea are compared. ``--threshold``
sets both caches' residual threshold (default: the plan's, 0.08): on a tiny random-weight
model the residuals move more from step to step than on a trained one, so at 0.08 neither
skips a step; a higher threshold compares them where they do.

    .venv/bin/python bench/step_caches.py [--families flux wan] [--steps 20] [--runs 5] [--threshold T]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware.probe import probe  # noqa: E402
from engine.policy.inference import InferenceRequest, plan_inference  # noqa: E402
from engine.preflight.model import resolve_model  # noqa: E402
from engine.runtime.session import GenerateRequest, InferenceSession  # noqa: E402

CACHES = ("off", "fbcache", "taylorseer", "magcache", "seacache")
#: cache-dit's DBCache, where the package is installed.
CACHE_DIT = "cache-dit"


def with_cache_dit(session: InferenceSession, steps: int, threshold: float) -> None:
    """cache-dit's DBCache on ``session``'s pipeline, set as the engine's First-Block-Cache:
    one block computed before deciding, none after, the same threshold, no forced warm-up."""
    import cache_dit

    cache_dit.enable_cache(session.pipeline, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold, max_warmup_steps=0,
        num_inference_steps=steps))


def render(session: InferenceSession, steps: int, frames: int | None) -> tuple[float, np.ndarray]:
    call = GenerateRequest(prompt="a lighthouse at dusk", steps=steps, seed=7, width=64, height=64, frames=frames)
    start = time.perf_counter()
    out = session.generate(call)
    took = time.perf_counter() - start
    images = list(out[0]) if frames else out
    return took, np.stack([np.asarray(image, dtype=np.float32) for image in images])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["flux", "wan"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=None, help="both caches' residual threshold")
    args = parser.parse_args()
    registry = load_registry()
    hardware = probe(verify=False)
    print(f"{args.steps} steps, 64 px, median of {args.runs} interleaved, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.1f}, residual threshold {args.threshold or 'as planned'}")
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            folder = registry.build_tiny_pipeline(registry.family(family), Path(scratch) / family, None)
            source = resolve_model(registry, folder)
            frames = 9 if registry.family(family).rendering.output == "frames" else None
            sessions = {}
            caches = (*CACHES, CACHE_DIT) if importlib.util.find_spec("cache_dit") else CACHES
            for cache in caches:
                request = InferenceRequest(step_cache="off" if cache == CACHE_DIT else cache, prompt_cache=False)
                plan = plan_inference(registry, source.facts(registry), hardware, request)
                if cache not in ("off", CACHE_DIT) and plan.value("step_cache") == "off":
                    print(f"  {family:6s} {cache:10s} not offered: {plan['step_cache'].reason}")
                    continue
                threshold = plan.step_cache_threshold if args.threshold is None else args.threshold
                sessions[cache] = InferenceSession(
                    registry, source, dataclasses.replace(plan, step_cache_threshold=threshold), request)
                sessions[cache].load()
                if cache == CACHE_DIT:
                    with_cache_dit(sessions[cache], args.steps, threshold)
                render(sessions[cache], args.steps, frames)  # warm-up
            caches = tuple(sessions)
            times: dict[str, list[float]] = {cache: [] for cache in caches}
            outputs: dict[str, np.ndarray] = {}
            for _ in range(args.runs):
                for cache in caches:
                    took, outputs[cache] = render(sessions[cache], args.steps, frames)
                    times[cache].append(took)
            base = statistics.median(times["off"])
            for cache in caches:
                median = statistics.median(times[cache])
                drift = float(np.abs(outputs[cache] - outputs["off"]).mean())
                print(f"  {family:6s} {cache:10s} {median:7.3f} s  {base / median:5.2f}x   drift {drift:6.2f} levels")
            for session in sessions.values():
                session.unload()


if __name__ == "__main__":
    main()
