"""Engine trainer steps/s vs a plain peft loop on the same tiny model.

Both train the same LoRA (same targets, rank, AdamW, lr, batch, seed) on the
same cached latents and prompt embeddings with the same family forward; the
plain loop is the textbook peft loop with nothing around it, its AdamW the same kernel the
engine's is (torch's fused one on the CPU: comparing the engine's fused step with an unfused
loop flattered the engine). Steady state:
the first steps are warm-up and not counted; the two sides alternate (plain, engine,
plain, engine...) and each prints its median. Target: engine / plain >= 1.0.

    .venv/bin/python bench/train_overhead.py [--families sdxl zimage] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402
from peft import LoraConfig  # noqa: E402

from engine.hardware.probe import probe  # noqa: E402
from engine.contract.plugins import load_registry  # noqa: E402
from engine.testing.datasets import write_dataset  # noqa: E402
from engine.training.config import TrainingConfig  # noqa: E402
from engine.training.preflight import preflight_training  # noqa: E402
from engine.training.buckets import fit  # noqa: E402
from engine.training.inputs import load_pixels  # noqa: E402
from engine.training.levers import adamw_kernel  # noqa: E402
from engine.training.trainer import run_training  # noqa: E402

WARMUP = 5


def engine_steps_per_s(plan, scratch: Path) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The engine trainer's median steps/s after warm-up, and its median CPU-s a step."""
    walls: list[float] = []
    cpus: list[float] = []
    last = [0.0, 0.0]

    def emit(event: dict[str, object]) -> None:
        if event["type"] == "started":
            last[:] = [time.perf_counter(), time.process_time()]
        elif event["type"] == "progress":
            now = [time.perf_counter(), time.process_time()]
            if int(event["step"]) > WARMUP:  # type: ignore[arg-type]
                walls.append(now[0] - last[0])
                cpus.append(now[1] - last[1])
            last[:] = now

    run_training(plan, scratch / "engine-out", emit, lambda: None)
    return 1 / statistics.median(walls), statistics.median(cpus)


def plain_steps_per_s(plan, steps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The textbook peft loop's median steps/s after warm-up, and its median CPU-s a step."""
    runtime = importlib.import_module(plan.family.runtime_module)
    torch.manual_seed(plan.config.seed)
    pipe = DiffusionPipeline.from_pretrained(plan.base.location, dtype=torch.float32)
    denoiser = getattr(pipe, plan.family.pipeline.denoiser)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
    device = torch.device("cpu")
    bucket = (plan.config.resolution, plan.config.resolution)  # the bench's square images
    with torch.no_grad():
        latents = [runtime.encode_images(pipe, load_pixels(i.image, fit(i.size, bucket)))[0] for i in plan.dataset.items]
        captions = sorted({i.caption for i in plan.dataset.items})
        cond_all = runtime.encode_prompts(pipe, captions, device, torch.float32)
    index = [captions.index(i.caption) for i in plan.dataset.items]
    denoiser.add_adapter(LoraConfig(r=plan.config.lora_rank, lora_alpha=plan.config.lora_rank,
                                    init_lora_weights="gaussian", target_modules=list(plan.lora_targets)))
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=plan.config.learning_rate, **adamw_kernel(params))  # the engine's kernel
    scheduler = runtime.training_scheduler(pipe) if plan.objective.prediction != "flow_matching" else None
    generator = torch.Generator().manual_seed(0)
    times, cpus = [], []
    denoiser.train()
    for step in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        batch = torch.randint(0, len(latents), (plan.config.batch_size,), generator=generator).tolist()
        x0 = torch.stack([latents[i] for i in batch])
        cond = {k: v[[index[i] for i in batch]] for k, v in cond_all.items()}
        noise = torch.randn(x0.shape, generator=generator)
        if scheduler is None:
            sigmas = torch.sigmoid(torch.randn(len(batch), generator=generator))
            s = sigmas.view(-1, 1, 1, 1)
            noisy, t, target = (1 - s) * x0 + s * noise, sigmas, noise - x0
        else:
            t = torch.randint(0, scheduler.config.num_train_timesteps, (len(batch),), generator=generator)
            noisy, target = scheduler.add_noise(x0, noise, t), noise
        loss = torch.nn.functional.mse_loss(runtime.predict(pipe, denoiser, noisy, t, cond).float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, plan.config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
    return 1 / statistics.median(times), statistics.median(cpus)


def compare(registry, family: str, scratch: Path, data: Path, steps: int, rounds: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The engine trainer against the plain loop on ``family``'s tiny pipeline, the sides
    alternating (plain, engine, plain, engine ...): medians, the ratio, and each round's."""
    base = registry.build_tiny_pipeline(registry.family(family), scratch / family)
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64,
        "steps": steps, "lora_rank": 4, "learning_rate": 1e-4, "device": "cpu",
    })
    plan = preflight_training(registry, config, probe(verify=False))
    plains, engines = [], []
    for _ in range(rounds):  # interleaved, A B A B: drift reaches both sides alike
        plains.append(plain_steps_per_s(plan, steps))
        engines.append(engine_steps_per_s(plan, scratch))
    plain = statistics.median(p for p, _ in plains)
    engine = statistics.median(e for e, _ in engines)
    return {
        "engine_it_s": engine, "plain_it_s": plain, "ratio": engine / plain,
        "engine_cpu_s": statistics.median(c for _, c in engines),
        "plain_cpu_s": statistics.median(c for _, c in plains),
        "rounds": [e / p for (e, _), (p, _) in zip(engines, plains)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["sdxl", "zimage", "qwen_image", "flux"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="plain, engine pairs, interleaved")
    args = parser.parse_args()
    diffusers_logging.set_verbosity_error()
    registry = load_registry()
    print(f"{'family':<12} {'engine it/s':>11} {'plain it/s':>11} {'ratio':>7} {'engine CPU-s':>13} "
          f"{'plain CPU-s':>12} {'CPU ratio':>10}   (CPU, batch 1, 64 px, medians after {WARMUP} warm-up steps; "
          "a CPU ratio is plain CPU-s / engine CPU-s, over 1 when the engine spends less)")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        data = write_dataset(scratch / "data", count=4, size=64)
        for family in args.families:
            row = compare(registry, family, scratch, data, args.steps, args.rounds)
            rounds = ", ".join(f"{r:.3f}" for r in row["rounds"])
            print(f"{family:<12} {row['engine_it_s']:>11.2f} {row['plain_it_s']:>11.2f} {row['ratio']:>7.3f} "
                  f"{row['engine_cpu_s']:>13.4f} {row['plain_cpu_s']:>12.4f} "
                  f"{row['plain_cpu_s'] / row['engine_cpu_s']:>10.3f}   per round: {rounds}")


if __name__ == "__main__":
    main()
