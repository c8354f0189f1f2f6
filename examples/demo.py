"""``make demo`` (examples/demo.py): the engine's two jobs on an embedded default.

No weights can be downloaded, so the demo builds a tiny random-weight FLUX.1
pipeline in ``out/tiny-flux`` (the real diffusers architecture, tiny widths;
kept, since the trained run names it as its base), asks the planner how
to run it here, generates an image through the real load/generate path,
trains a LoRA on it for a few steps (a small drawn dataset, the real trainer
in its child process) with sample images rendered by the LoRA as it learns
(``runs show`` lists them), and shows what the same engine would decide for
the real model on an RTX 4090. Everything goes through the public CLI; it
ends on the command that generates with the LoRA it trained.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from engine.cli import main as cli
from engine.logs import quiet_library_logs
from engine.testing.datasets import write_dataset

OUT = Path("out")


def main() -> int:
    quiet_library_logs(progress_bars=False)
    # The pipeline lives beside the run it trains: the run record names it as its base, so
    # ``generate --lora RUN`` works after the demo (a temporary folder would be gone).
    tiny = _tiny_flux(OUT / "tiny-flux")
    data = write_dataset(OUT / "demo-data", count=4, size=64)
    steps = [
        ("families installed", ["families"]),
        ("plan for the tiny FLUX.1 pipeline on this machine", ["plan", "--model", str(tiny)]),
        (
            "generate with it",
            ["generate", "--model", str(tiny), "--prompt", "a lighthouse at dusk",
             "--width", "128", "--height", "96", "--steps", "8", "-o", str(OUT / "demo-flux.png"),
             "--overwrite"],  # `make demo` again replaces the demo's own image
        ),
        (
            "train a LoRA on it (8 steps, CPU), with a sample image every 4 steps",
            ["train", "--base", str(tiny), "--data", str(data), "--steps", "8", "--resolution", "64",
             "--rank", "4", "--lr", "1e-3", "--device", "cpu", "--runs-dir", str(OUT / "runs"),
             "--sample-prompt", "a red circle on a blue background", "--sample-every", "4",
             "--sample-steps", "4"],
        ),
        ("the runs so far", ["runs", "--runs-dir", str(OUT / "runs")]),
        ("the run just trained: its config, metrics and samples", ["runs", "show", "--runs-dir", str(OUT / "runs")]),
        ("the real FLUX.1-dev on an RTX 4090 (--hardware rtx4090)",
         ["plan", "--family", "flux", "--hardware", "rtx4090"]),
    ]
    for title, argv in steps:
        if argv[:2] == ["runs", "show"]:
            argv = [*argv[:2], _newest_run(OUT / "runs"), *argv[2:]]
        print(f"\n== {title}: diffusion-engine {' '.join(argv)}")
        status = cli(argv)
        if status:
            return status
    print(f"\nThe image is at {(OUT / 'demo-flux.png').resolve()}; the LoRA, its run record, "
          f"loss / LR / grad-norm charts and the sample images (samples/) are in the run folder above, "
          f"under {(OUT / 'runs').resolve()}")
    print(f"Next, the LoRA on its base: {shlex.join(next_command(OUT, _newest_run(OUT / 'runs')))}")
    return 0


def next_command(out: Path, run_id: str) -> list[str]:
    """The command the demo ends on: its tiny base with the LoRA it just trained."""
    return ["diffusion-engine", "generate", "--model", str(out / "tiny-flux"), "--lora", str(out / "runs" / run_id),
            "--prompt", "a red circle on a blue background",
            "--width", "64", "--height", "64", "--steps", "4", "-o", str(out / "demo-lora.png"), "--overwrite"]


def _tiny_flux(folder: Path) -> Path:
    """The demo's tiny FLUX.1 pipeline in ``folder``, built once (a later demo reuses it, so
    earlier runs keep their base)."""
    if (folder / "model_index.json").is_file():
        return folder
    from engine.contract.plugins import load_registry

    registry = load_registry()
    return Path(registry.build_tiny_pipeline(registry.family("flux"), folder))


def _newest_run(runs_dir: Path) -> str:
    """The id of the run the demo just trained (the newest record in ``runs_dir``)."""
    from engine.training.records import list_runs

    return max(list_runs(runs_dir), key=lambda record: record.created_at).run_id


if __name__ == "__main__":
    raise SystemExit(main())
