"""Cold-process wall time of each cheap refusal vs `import torch`, in one run.

Every argument, path, value and family check runs before torch, diffusers or
transformers are imported, so a refusal answers in a fraction of what
importing torch takes. Each case runs the real CLI as a fresh interpreter,
alternating with `python -c "import torch"`; the script prints each median,
its ratio to the torch import's median, the refusal code, and whether torch
was imported (target: every ratio under 0.5, torch never imported).

    .venv/bin/python bench/refusal_latency.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from info_latency import wall  # bench/ is on sys.path when a script in it runs

#: Set in the child: print whether torch was imported when the process ends.
PROBE = ("import atexit, sys; atexit.register(lambda: sys.stderr.write("
         "'\\ntorch-imported=%s\\n' % ('torch' in sys.modules))); "
         "from engine.cli import main; sys.exit(main(sys.argv[1:]))")


def cases(scratch: Path) -> list[tuple[str, list[str]]]:
    model, data = scratch / "tiny-flux", scratch / "data"
    missing = scratch / "missing"
    return [
        ("generate: a missing LoRA", ["generate", "--model", str(model), "--prompt", "x", "-o",
                                      str(scratch / "a.png"), "--lora", str(missing / "x.safetensors")]),
        ("generate: a missing input image", ["generate", "--model", str(model), "--prompt", "x", "-o",
                                             str(scratch / "b.png"), "--image", str(missing / "x.png")]),
        ("generate: --quant int4", ["generate", "--model", str(model), "--prompt", "x", "--quant", "int4"]),
        ("generate: a hub id, no consent", ["generate", "--model", "someone/not-here", "--family", "flux",
                                            "--prompt", "x", "-o", str(scratch / "c.png")]),
        ("generate: an unknown --tiny family", ["generate", "--tiny", "nosuch", "--prompt", "x"]),
        ("generate: --width 100", ["generate", "--model", str(model), "--prompt", "x", "--width", "100"]),
        ("train: a missing dataset", ["train", "--base", str(model), "--data", str(missing), "--dry-run"]),
        ("train: a missing dataset (start)", ["train", "--base", str(model), "--data", str(missing),
                                              "--device", "cpu", "--runs-dir", str(scratch / "runs")]),
        ("train: --base-precision int4", ["train", "--base", str(model), "--data", str(data),
                                          "--base-precision", "int4", "--dry-run"]),
        ("train: --mixed-precision bf16 on a T4", ["train", "--base", "flux.1-dev", "--data", str(data),
                                                   "--hardware", "t4", "--dry-run"]),
        ("plan: --quant int4", ["plan", "--family", "flux", "--quant", "int4"]),
        ("plan: an unknown family", ["plan", "--family", "nosuch"]),
    ]


def run(args: list[str]) -> tuple[float, str, bool]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - start
    code = next((line.split("]")[0].removeprefix("error[") for line in done.stderr.splitlines()
                 if line.startswith("error[")), f"exit {done.returncode}")
    return seconds, code, "torch-imported=True" in done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    torch_cmd = [sys.executable, "-c", "import torch"]
    with tempfile.TemporaryDirectory(prefix="refusal-latency-") as folder:
        scratch = Path(folder)
        subprocess.run([sys.executable, "-m", "engine", "tiny", "save", "flux", str(scratch / "tiny-flux")],
                       check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "engine", "tiny", "dataset", str(scratch / "data")],
                       check=True, capture_output=True)
        table = cases(scratch)
        wall(torch_cmd)  # warm the OS file cache
        torch_times: list[float] = []
        results: dict[str, list[tuple[float, str, bool]]] = {name: [] for name, _ in table}
        for _ in range(runs):
            torch_times.append(wall(torch_cmd))
            for name, args in table:
                results[name].append(run(args))
    torch_s = statistics.median(torch_times)
    print(f"{'python -c import torch':<40} {torch_s:6.3f} s (median of {runs})")
    worst = 0.0
    for name, measured in results.items():
        seconds = statistics.median(m[0] for m in measured)
        codes = {m[1] for m in measured}
        imported = any(m[2] for m in measured)
        worst = max(worst, seconds / torch_s)
        print(f"{name:<40} {seconds:6.3f} s  ratio {seconds / torch_s:5.2f}  {'/'.join(sorted(codes)):<26}"
              f" torch {'IMPORTED' if imported else 'not imported'}")
    print(f"worst ratio {worst:.2f} (target < 0.5 for every case)")


if __name__ == "__main__":
    main()
