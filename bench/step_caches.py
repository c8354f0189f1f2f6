"""Step caches side by side on the same tiny pipeline: speed and drift against no cache.

Each cache (``off``, ``fbcache``, ``taylorseer``) renders the same prompt, seed and steps
through the engine's own session; the caches alternate call by call after a warm-up call
each, and medians are compared. Drift is the mean absolute difference from the uncached
image, in 8-bit levels (a clip's every frame), at the same seed.

    .venv/bin/python bench/step_caches.py [--families flux wan] [--steps 20] [--runs 5]
"""

from __future__ import annotations

import argparse
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

CACHES = ("off", "fbcache", "taylorseer")


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
    args = parser.parse_args()
    registry = load_registry()
    hardware = probe(verify=False)
    print(f"{args.steps} steps, 64 px, median of {args.runs} interleaved, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            folder = registry.build_tiny_pipeline(registry.family(family), Path(scratch) / family, None)
            source = resolve_model(registry, folder)
            frames = 9 if registry.family(family).rendering.output == "frames" else None
            sessions = {}
            for cache in CACHES:
                request = InferenceRequest(step_cache=cache, prompt_cache=False)
                sessions[cache] = InferenceSession(registry, source, plan_inference(
                    registry, source.facts(registry), hardware, request), request)
                sessions[cache].load()
                render(sessions[cache], args.steps, frames)  # warm-up
            times: dict[str, list[float]] = {cache: [] for cache in CACHES}
            outputs: dict[str, np.ndarray] = {}
            for _ in range(args.runs):
                for cache in CACHES:
                    took, outputs[cache] = render(sessions[cache], args.steps, frames)
                    times[cache].append(took)
            base = statistics.median(times["off"])
            for cache in CACHES:
                median = statistics.median(times[cache])
                drift = float(np.abs(outputs[cache] - outputs["off"]).mean())
                print(f"  {family:6s} {cache:10s} {median:7.3f} s  {base / median:5.2f}x   drift {drift:6.2f} levels")
            for session in sessions.values():
                session.unload()


if __name__ == "__main__":
    main()
