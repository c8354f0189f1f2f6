"""One request on 1, 2, ... ranks: the speedup of each split degree on this machine's GPUs (or CPU).

Each degree renders the same clip (same seed, steps, size) through the engine's own door,
``engine.videos.generate(ticket)`` with ``gpus=N`` (1: one process, the loaded model); the
degrees alternate run by run (1, 2, 1, 2...) and medians are compared. Two figures per degree:

* **denoise**: first to last step, from the progress the ranks report (what the split divides);
* **request**: the whole call, which for N > 1 includes starting the ranks and loading the
  model in each (a split request's ranks are new each time: forked from the engine's warm
  fork server on Linux, so torch and diffusers are not imported again).

On a CPU the ranks are gloo processes sharing the cores (each gets cores / N threads, the
single process all of them), so a CPU shows what the split costs in exchanges rather than
what GPUs gain. On GPUs each rank has its own.

    .venv/bin/python bench/parallel_scaling.py [--family wan] [--degrees 1 2] [--kind auto] [--runs 3]
        [--size 256] [--frames 33] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import Engine  # noqa: E402
from engine.contract.plugins import load_registry  # noqa: E402
from engine.requests.bodies import GenerateBody  # noqa: E402
from engine.requests.inference import InferenceRequest  # noqa: E402


def run(engine: Engine, folder: Path, degree: int, args: argparse.Namespace) -> tuple[float, float]:
    """(denoise seconds, request seconds) for one render at ``degree``."""
    body = GenerateBody(prompt="a lighthouse at dusk", model=str(folder), seed=1, steps=args.steps,
                        width=args.size, height=args.size, frames=args.frames)
    request = InferenceRequest(step_cache="off", gpus=degree if degree > 1 else None,
                               parallel=args.kind if degree > 1 else "auto")
    ticket = engine.videos.check_generate(body, request=request)
    marks: list[float] = []
    start = time.perf_counter()
    engine.videos.generate(ticket, progress=lambda step, total: marks.append(time.perf_counter()))
    took = time.perf_counter() - start
    steps = len(marks) - 1  # first to last step: the steps between them
    return (marks[-1] - marks[0]) * args.steps / max(steps, 1), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="wan")
    parser.add_argument("--degrees", type=int, nargs="+", default=None,
                        help="default: 1, 2, 4... up to this machine's GPUs (1 and 2 on a CPU)")
    parser.add_argument("--kind", default="auto", choices=("auto", "ulysses", "ring", "cfg"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    registry = load_registry()
    with tempfile.TemporaryDirectory() as scratch, Engine(allow_download=False) as engine:
        folder = registry.build_tiny_pipeline(registry.family(args.family), Path(scratch) / args.family, None)
        hardware = engine.hardware()
        if args.degrees is None:
            most = max(1, len(hardware.devices)) if hardware.cuda else 2
            args.degrees = [d for d in (1, 2, 4, 8, 16) if d <= most]
        for degree in args.degrees:  # warm: each degree once, unmeasured (imports, caches)
            run(engine, folder, degree, args)
        times: dict[int, list[tuple[float, float]]] = {d: [] for d in args.degrees}
        for _ in range(args.runs):
            for degree in args.degrees:
                times[degree].append(run(engine, folder, degree, args))
        load = os.getloadavg()[0]
        label = engine.videos.check_generate(
            GenerateBody(prompt="x", model=str(folder), width=args.size, height=args.size, frames=args.frames),
            request=InferenceRequest(gpus=max(args.degrees), parallel=args.kind)).plan["parallel"].value \
            if max(args.degrees) > 1 else "off"
    print(f"{args.family} tiny, {args.frames} frames at {args.size} px, {args.steps} steps, split {label}; "
          f"{hardware.device_name}, load {load:.1f}, median of {args.runs} interleaved runs")
    base_denoise = statistics.median(t[0] for t in times[args.degrees[0]])
    base_request = statistics.median(t[1] for t in times[args.degrees[0]])
    for degree in args.degrees:
        denoise = statistics.median(t[0] for t in times[degree])
        request = statistics.median(t[1] for t in times[degree])
        print(f"  {degree} rank{'s' if degree > 1 else ' '}: denoise {denoise:6.2f} s ({base_denoise / denoise:4.2f}x)"
              f"   request {request:6.2f} s ({base_request / request:4.2f}x)")


if __name__ == "__main__":
    main()
