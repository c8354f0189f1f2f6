"""Cold-process cost of the light commands against `import torch`, wall and CPU time.

Each command and the torch import run as fresh interpreters, interleaved (A B C ... A B C
...), several times, with PYTHONDONTWRITEBYTECODE=1 (as many container images set it: only
the byte-code the install wrote is read); the script prints each median, wall and CPU seconds
(user + system of the child, so other load on the machine drops out), and its ratio to the
torch import. Targets: `--version`, `info` and `plan` under 1/10 of the torch import; none of
them may import torch on a machine without a GPU.

    .venv/bin/python bench/info_latency.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

COMMANDS: dict[str, list[str]] = {
    "import torch": [sys.executable, "-c", "import torch"],
    "diffusion-engine --version": [sys.executable, "-m", "engine", "--version"],
    "diffusion-engine --help": [sys.executable, "-m", "engine", "--help"],
    "diffusion-engine info --json": [sys.executable, "-m", "engine", "info", "--json"],
    "diffusion-engine plan --family flux": [sys.executable, "-m", "engine", "plan", "--family", "flux",
                                            "--hardware", "rtx4090"],
}
TARGETS = {"diffusion-engine --version": 0.1, "diffusion-engine info --json": 0.1,
           "diffusion-engine plan --family flux": 0.1}


def timed(command: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one cold run of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                        "PYTHONDONTWRITEBYTECODE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    for command in COMMANDS.values():
        timed(command)  # warm the OS file cache for each
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, command in COMMANDS.items():  # interleaved: drift reaches every side alike
            samples[name].append(timed(command))
    torch_wall = statistics.median(w for w, _ in samples["import torch"])
    torch_cpu = statistics.median(c for _, c in samples["import torch"])
    print(f"median of {runs} interleaved cold runs; ratios against `import torch`")
    for name in COMMANDS:
        wall = statistics.median(w for w, _ in samples[name])
        cpu = statistics.median(c for _, c in samples[name])
        target = f"  (target < {TARGETS[name]})" if name in TARGETS else ""
        print(f"{name:<38} wall {wall:.3f} s  CPU {cpu:.3f} s  ratio wall {wall / torch_wall:.3f}, "
              f"CPU {cpu / torch_cpu:.3f}{target}")


if __name__ == "__main__":
    main()
