"""How long a training run takes to start: a trainer forked from the warm server against a
fresh ``python -m engine.training.child``, the sides alternating (A B A B) in one engine.

Each run is a tiny pipeline's 1-step LoRA through ``Engine.training.start``; timed from
the call to its first step, and to its end, wall and CPU seconds (this process's and
its reaped children's, plus the fork server's and those it reaped, read from /proc). The fork server is started (and its imports paid)
before the rounds, as a server or a second run of one process finds it.

    .venv/bin/python bench/train_start.py [--family sdxl] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402

from engine import Engine  # noqa: E402
from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware.probe import probe  # noqa: E402
from engine.testing.datasets import write_dataset  # noqa: E402
from engine.training import forkserver  # noqa: E402


def cpu_seconds() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in psutil.Process().children(recursive=True):  # the fork server and what it reaped
        try:
            spent = child.cpu_times()
            total += spent.user + spent.system + spent.children_user + spent.children_system
        except psutil.Error:
            continue
    return total


def one_run(engine: Engine, config: dict[str, object]) -> tuple[float, float, float]:
    """Seconds to the first step, to the end, and CPU seconds to the end."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    engine.training.start(config)
    first = None
    while True:
        status = engine.training.status() or {}
        if first is None and int(status.get("step", 0) or 0) >= 1:  # type: ignore[call-overload]
            first = time.perf_counter() - wall
        if status.get("status") in ("completed", "failed", "cancelled", "stopped"):
            break
        time.sleep(0.02)
    assert status["status"] == "completed", status
    end = time.perf_counter() - wall
    return first or end, end, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sdxl")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not forkserver.available():
        raise SystemExit("the fork server is Linux's (and on by default); nothing to compare here")
    registry = load_registry()
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        base = registry.build_tiny_pipeline(registry.family(args.family), scratch / args.family)
        data = write_dataset(scratch / "data", count=2, size=64)
        config = {"base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": 1,
                  "lora_rank": 2, "device": "cpu"}
        engine = Engine(hardware=probe(verify=False), runs_dir=scratch / "runs")
        forkserver.server()  # warm, as a server's second run finds it
        one_run(engine, config)  # the first run of each kind pays its own one-time costs
        sides: dict[str, list[tuple[float, float, float]]] = {"fresh": [], "forked": []}
        for _ in range(args.rounds):  # A B A B
            for side, switch in (("fresh", "0"), ("forked", "1")):
                os.environ[forkserver.ENV_SWITCH] = switch
                sides[side].append(one_run(engine, config))
    print(f"{args.family} 1-step LoRA run, median of {args.rounds}, sides alternating")
    print(f"{'trainer':<8} {'first step s':>13} {'end s':>7} {'CPU s':>7}")
    for side, runs in sides.items():
        first, end, cpu = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{side:<8} {first:>13.2f} {end:>7.2f} {cpu:>7.2f}")
    fresh, forked = (statistics.median(r[1] for r in sides[s]) for s in ("fresh", "forked"))
    print(f"forked / fresh, to the end: {forked / fresh:.2f}")


if __name__ == "__main__":
    main()
