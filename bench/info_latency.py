"""Cold-process wall time of `diffusion-engine info --json` vs `import torch`.

Both run as fresh interpreters, alternating, several times; the script
prints the medians and their ratio. Targets: info under 0.3 s, and under 1/5
of the torch import (info must never import torch on a machine without a GPU).

    .venv/bin/python bench/info_latency.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    info_cmd = [sys.executable, "-m", "engine", "info", "--json"]
    torch_cmd = [sys.executable, "-c", "import torch"]
    wall(info_cmd), wall(torch_cmd)  # warm the OS file cache for both
    info, torch = [], []
    for _ in range(runs):
        info.append(wall(info_cmd))
        torch.append(wall(torch_cmd))
    info_s, torch_s = statistics.median(info), statistics.median(torch)
    print(f"diffusion-engine info --json : {info_s:.3f} s (median of {runs})")
    print(f"python -c 'import torch'      : {torch_s:.3f} s (median of {runs})")
    print(f"ratio info / torch import     : {info_s / torch_s:.3f}  (target < 0.2; info target < 0.3 s)")


if __name__ == "__main__":
    main()
