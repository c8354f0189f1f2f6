"""What an unload costs, with the process's long-lived objects frozen (the engine's way) and not.

Every unload runs a full garbage collection (a dropped model's reference cycles are freed
before the next model loads). The engine freezes the objects that exist before its first
model is built (:func:`engine.runtime.heap.settle`), so the collection walks only what
came after. This bench loads and unloads the same tiny pipeline through a session, the
two sides interleaved (A B A B) in one process: frozen as the engine runs, and unfrozen
(``gc.unfreeze()`` before each of its loads, as before the change). It prints the median
unload and load-plus-unload of each side, their ratio, and how many objects a collection
walks on each.

    .venv/bin/python bench/model_switch.py [--family flux] [--runs 9]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware.probe import probe  # noqa: E402
from engine.policy.inference import InferenceRequest, plan_inference  # noqa: E402
from engine.preflight.model import resolve_model  # noqa: E402
from engine.runtime import heap  # noqa: E402
from engine.runtime.session import InferenceSession  # noqa: E402


def cycle(registry: object, source: object, plan: object, request: object, frozen: bool) -> tuple[float, float, int]:
    """(load + unload s, unload s, objects a collection walks) of one session."""
    if not frozen:
        gc.unfreeze()  # the old way: every object the process holds is walked
    session = InferenceSession(registry, source, plan, request)  # type: ignore[arg-type]
    started = time.perf_counter()
    session.load()
    loaded = time.perf_counter()
    walked = len(gc.get_objects())  # what the unload's collection walks (the frozen excluded)
    unloading = time.perf_counter()
    session.unload()
    done = time.perf_counter()
    if not frozen:
        gc.freeze()
    return (loaded - started) + (done - unloading), done - unloading, walked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry = load_registry()
    folder = registry.build_tiny_pipeline(registry.family(args.family), Path(tempfile.mkdtemp()) / "tiny")
    source = resolve_model(registry, folder)
    hardware = probe(verify=False)
    request = InferenceRequest()
    plan = plan_inference(registry, source.facts(registry), hardware, request)
    heap.settle()  # what the engine's first load does
    cycle(registry, source, plan, request, True)  # warm-up: the libraries' lazy imports happen once
    sides: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
    for _ in range(args.runs):
        for frozen in (True, False):  # interleaved
            sides[frozen].append(cycle(registry, source, plan, request, frozen))
    print(f"tiny {args.family}, {args.runs} interleaved load/unload cycles, 1 torch thread, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for frozen, label in ((True, "frozen (engine)"), (False, "unfrozen (before)")):
        total = statistics.median(s[0] for s in sides[frozen])
        unload = statistics.median(s[1] for s in sides[frozen])
        print(f"{label:<18} load+unload {total:.3f} s  unload {unload:.3f} s  "
              f"collection walks {statistics.median(s[2] for s in sides[frozen]):,.0f} objects")
    ratio = statistics.median(s[1] for s in sides[False]) / statistics.median(s[1] for s in sides[True])
    print(f"unload: the frozen side {ratio:.1f}x faster")


if __name__ == "__main__":
    main()
