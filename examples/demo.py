"""``make demo`` (examples/demo.py): the engine's main job on an embedded default.

No weights can be downloaded, so the demo builds a tiny random-weight FLUX.1
pipeline (the real diffusers architecture, tiny widths), asks the planner how
to run it here, generates an image through the real load/generate path, and
then shows what the same engine would decide for the real model on an RTX
4090. Everything goes through the public CLI entry points.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from engine.cli import main as cli

OUT = Path("out")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-demo-") as scratch:
        from engine.plugins import load_registry

        registry = load_registry()
        tiny = registry.build_tiny_pipeline(registry.family("flux"), Path(scratch) / "tiny-flux")
        steps = [
            ("families installed", ["families"]),
            ("plan for the tiny FLUX.1 pipeline on this machine", ["plan", "--model", str(tiny)]),
            (
                "generate with it",
                ["generate", "--model", str(tiny), "--prompt", "a lighthouse at dusk",
                 "--width", "128", "--height", "96", "--steps", "8", "-o", str(OUT / "demo-flux.png")],
            ),
            ("the real FLUX.1-dev on an RTX 4090 (--hardware rtx4090)",
             ["plan", "--family", "flux", "--hardware", "rtx4090"]),
        ]
        for title, argv in steps:
            print(f"\n== {title}: diffusion-engine {' '.join(argv)}")
            status = cli(argv)
            if status:
                return status
    print(f"\nThe image is at {(OUT / 'demo-flux.png').resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
