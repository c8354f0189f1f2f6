"""The CPU path's speed, side by side in one run: a generate against this CPU's GEMM peak
and against plain diffusers fp32, and the trainer against a plain peft loop.

The generate runs a FLUX.1 pipeline whose transformer has FLUX.1's real width (3072,
24 heads of 128) and fewer blocks (``--double``, ``--single``), with the tiny text
encoders and VAE (a tiny transformer is all overhead and says nothing of the GEMMs).
Its weights are stored in bf16, as FLUX.1 is published. Two sides, alternating (plain,
engine, plain, engine, ...) after a warm-up call of each, the same prompt, size, steps
and seed, the same threads:

* **plain**: ``DiffusionPipeline.from_pretrained(folder, dtype=...)``, fp32 as diffusers'
  docs write a CPU run, or ``--plain-dtype bf16``: each component in the dtype the engine's
  plan loads it in (bf16 on a CPU that multiplies it natively, a video VAE fp32: like for like);
* **engine**: the engine's own session with ``--speed`` (default: ``default``), the
  step cache and the prompt cache off so both sides do the same work; its dtype and
  GEMM kernel are the plan's, read from this CPU (``engine/policy/cpu_kernel.py``).

Each side's achieved GFLOP/s is the call's FLOPs (counted on each side's warm-up call with
torch's ``FlopCounterMode``: every matmul, convolution and attention; the two counts must
agree, or the bench says the sides did different work) over its median wall
time, printed against the peak this CPU's GEMM reached for that dtype and kernel
(``engine/hardware/gemm.py``, measured once per machine and cached). Wall and CPU
seconds are printed side by side.

The trainer: ``bench/train_overhead.py``'s comparison on one family (the engine's
trainer against the textbook peft loop, same LoRA and data, sides alternating).

``--family wan``: the same comparison on a Wan-width slice, the tiny Wan pipeline (Wan 2.2
TI2V-5B-shaped: 48 latent channels) with its transformer widened to Wan 2.2 TI2V-5B's 3072
(24 heads of 128, its feed-forward ratio) and ``--blocks`` blocks, a ``--frames`` clip,
guidance at the checkpoint's default on both sides.

Targets: the engine's generate at >= 70% of the GEMM peak, >= 1.5x plain diffusers
fp32 where bf16 or oneDNN applies; the trainer >= 1.0 of the plain loop.

    .venv/bin/python bench/cpu_speed.py [--family flux|wan] [--size 256] [--steps 4] [--rounds 3]
        [--double 1] [--single 2] [--blocks 2] [--frames 9]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from diffusers import DiffusionPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import train_overhead  # noqa: E402
from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware import gemm  # noqa: E402
from engine.hardware.cpu import cpu_model, physical_cores  # noqa: E402
from engine.hardware.probe import probe  # noqa: E402
from engine.policy.inference import InferenceRequest, plan_inference  # noqa: E402
from engine.preflight.model import resolve_model  # noqa: E402
from engine.runtime.session import GenerateRequest, InferenceSession  # noqa: E402
from engine.testing.datasets import write_dataset  # noqa: E402
from engine.testing.stock import stock_dtypes  # noqa: E402

PROMPT = "a lighthouse at dusk"
#: FLUX.1's head width; the width is heads x this.
HEAD_DIM = 128


def write_pipeline(registry: Any, folder: Path, width: int, double: int, single: int) -> Path:
    """The tiny FLUX pipeline with its transformer replaced by a FLUX.1-wide one, in bf16."""
    registry.build_tiny_pipeline(registry.family("flux"), folder)
    tiny = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    config = {k: v for k, v in tiny.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    wide = FluxTransformer2DModel(**{**config, "num_layers": double, "num_single_layers": single,
                                     "num_attention_heads": width // HEAD_DIM, "attention_head_dim": HEAD_DIM})
    wide.to(torch.bfloat16).save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


#: Wan 2.2 TI2V-5B's feed-forward width over its model width (14336 / 3072).
WAN_FFN_RATIO = 14336 / 3072


def write_wan_pipeline(registry: Any, folder: Path, width: int, blocks: int) -> Path:
    """The tiny Wan pipeline with its transformer replaced by a Wan-wide one, in bf16."""
    from diffusers import WanTransformer3DModel

    registry.build_tiny_pipeline(registry.family("wan"), folder)
    tiny = WanTransformer3DModel.from_pretrained(folder / "transformer")
    config = {k: v for k, v in tiny.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    wide = WanTransformer3DModel(**{**config, "num_layers": blocks, "num_attention_heads": width // HEAD_DIM,
                                    "attention_head_dim": HEAD_DIM, "ffn_dim": round(width * WAN_FFN_RATIO)})
    wide.to(torch.bfloat16).save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def _onednn_linear_flops(x_shape: Any, weight_shape: Any, *_: Any, **__: Any) -> int:
    """``mkldnn._linear_pointwise``'s FLOPs: a product of ``x`` by the weight's transpose."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * weight_shape[0]


def counted_flops(run: Callable[[], Any]) -> int:
    """The FLOPs of ``run()``, torch's ``FlopCounterMode`` taught oneDNN's fp32 linear (the engine's
    CPU kernel where it measured faster than MKL): torch's counter knows aten's products only, and
    missed every linear of a oneDNN plan."""
    custom = {torch.ops.mkldnn._linear_pointwise: _onednn_linear_flops} if gemm.onednn_available() else {}
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        run()
    return int(counter.get_total_flops())


def timed(call: Callable[[], Any]) -> tuple[float, float]:
    """Wall and process CPU seconds of one call (CPU time: every thread of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def peak_for(plan: Any, figures: gemm.CpuGemm) -> tuple[float, str]:
    """The measured GEMM GFLOP/s for the plan's dtype and kernel, and its name."""
    if plan.value("dtype") == "bf16":
        return figures.bf16, "bf16 (oneDNN)"
    if plan.value("cpu_kernel") == "onednn":
        return figures.fp32_onednn, "fp32 oneDNN"
    return figures.fp32_mkl, "fp32 MKL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("flux", "wan"), default="flux", help="the slice: FLUX.1- or Wan-wide")
    parser.add_argument("--blocks", type=int, default=2, help="Wan blocks (Wan 2.2 TI2V-5B has 30)")
    parser.add_argument("--frames", type=int, default=9, help="a Wan slice's clip length")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="plain, engine pairs, interleaved")
    parser.add_argument("--width", type=int, default=3072, help="transformer width (FLUX.1: 3072)")
    parser.add_argument("--double", type=int, default=1, help="double-stream blocks (FLUX.1 has 19)")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks (FLUX.1 has 38)")
    parser.add_argument("--speed", default="default", help="the engine side's speed tier (auto: the default)")
    parser.add_argument("--plain-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="plain diffusers' dtype (bf16: like for like with the engine's bf16 default)")
    parser.add_argument("--skip-train", action="store_true", help="the generate comparison alone")
    parser.add_argument("--train-family", default="flux")
    parser.add_argument("--train-steps", type=int, default=25)
    args = parser.parse_args()
    diffusers_logging.set_verbosity_error()
    registry = load_registry()
    threads = gemm.default_threads()
    torch.set_num_threads(threads)
    hardware = probe(verify=False)
    figures = gemm.measured(hardware.cpu_isa or "", threads)
    print(f"CPU: {cpu_model() or 'unknown'}, matmul ISA {hardware.cpu_isa or 'unknown'}, "
          f"{physical_cores()} physical cores, {threads} threads")
    print(f"GEMM peak (256x3072x3072, GFLOP/s): fp32 MKL {figures.fp32_mkl:.0f}, fp32 oneDNN "
          f"{figures.fp32_onednn:.0f}, bf16 {figures.bf16:.0f}")

    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        video = args.family == "wan"
        folder = (write_wan_pipeline(registry, scratch / "wan-wide", args.width, args.blocks) if video
                  else write_pipeline(registry, scratch / "flux-wide", args.width, args.double, args.single))
        request = InferenceRequest(speed=args.speed, step_cache="off", prompt_cache=False, threads=threads,
                                   width=args.size, height=args.size, frames=args.frames if video else None)
        source = resolve_model(registry, folder)
        plan = plan_inference(registry, source.facts(registry), hardware, request)
        engine = InferenceSession(registry, source, plan, request)
        engine.load()
        plan = engine.plan
        for control in ("engine", "dtype", "cpu_kernel", "compile"):
            entry = plan.controls[control]
            print(f"engine plan: {control} = {entry.value} ({entry.reason})")
        # bf16: like for like, each component in the dtype the plan loads it in (a video VAE
        # stays fp32 in the engine's plan; a whole-pipeline bf16 would decode faster, and worse)
        plain_dtype = (stock_dtypes(folder, source.family, plan) if args.plain_dtype == "bf16"
                       else torch.float32)
        plain = DiffusionPipeline.from_pretrained(folder, dtype=plain_dtype)
        plain.set_progress_bar_config(disable=True)
        # The pipeline's own defaults otherwise (FLUX: 512 T5 tokens), as the engine calls it: the same work
        guidance = (source.checkpoint or source.family.default_checkpoint).default_guidance
        call: dict[str, Any] = {"num_inference_steps": args.steps, "width": args.size, "height": args.size,
                                "guidance_scale": guidance}
        if video:
            call.update(num_frames=args.frames, output_type="pil")

        def run_plain() -> None:
            with torch.inference_mode():
                plain(PROMPT, generator=torch.Generator("cpu").manual_seed(0), **call)

        def run_engine() -> None:
            engine.generate(GenerateRequest(PROMPT, steps=args.steps, width=args.size, height=args.size, seed=0,
                                            guidance=guidance, frames=args.frames if video else None))

        counted = {}
        for side, run in (("plain", run_plain), ("engine", run_engine)):  # each side's warm-up call, counted
            counted[side] = counted_flops(run)
        flops = counted["plain"]
        if counted["engine"] > 1.01 * flops:  # the comparison is void: say so, loudly
            print(f"THE SIDES DID DIFFERENT WORK: plain {flops / 1e9:.0f} GFLOP, engine {counted['engine'] / 1e9:.0f}")
        elif counted["engine"] < 0.99 * flops:  # the same image for less work: the engine's exact caches
            print(f"the engine computed {1 - counted['engine'] / flops:.0%} fewer FLOPs than plain diffusers "
                  "for the same output (its exact caches: the prompt's keys and values once per call)")
        sides: dict[str, list[tuple[float, float]]] = {"plain": [], "engine": []}
        for _ in range(args.rounds):  # A B A B: drift reaches both sides alike
            sides["plain"].append(timed(run_plain))
            sides["engine"].append(timed(run_engine))
        engine.unload()

        wall = {side: statistics.median(w for w, _ in runs) for side, runs in sides.items()}
        cpu = {side: statistics.median(c for _, c in runs) for side, runs in sides.items()}
        peaks = {"plain": (figures.bf16, "bf16 (oneDNN)") if args.plain_dtype == "bf16" else (figures.fp32_mkl, "fp32 MKL"),
                 "engine": peak_for(plan, figures)}
        shape = (f"Wan width {args.width}, {args.blocks} blocks, {args.frames} frames at" if video else
                 f"FLUX.1 width {args.width}, {args.double} double + {args.single} single blocks,")
        print(f"\ngenerate: {shape} {args.size} px, {args.steps} steps, guidance {guidance}, {flops / 1e9:.0f} GFLOP a "
              f"call (engine: {counted['engine'] / 1e9:.0f}), median of {args.rounds}")
        print(f"{'side':<8} {'wall s':>8} {'CPU s':>8} {'GFLOP/s':>9} {'GEMM peak':>10} {'of peak':>8}  kernel")
        share = {}
        for side in ("plain", "engine"):
            achieved = counted[side] / wall[side] / 1e9  # each side's own work over its own time
            peak, kernel = peaks[side]
            share[side] = achieved / peak if peak else 0.0
            print(f"{side:<8} {wall[side]:>8.3f} {cpu[side]:>8.3f} {achieved:>9.1f} {peak:>10.1f} "
                  f"{share[side]:>7.0%}  {kernel}")
        speedup = wall["plain"] / wall["engine"]
        print(f"engine vs plain diffusers {args.plain_dtype}: {speedup:.2f}x wall, {cpu['plain'] / cpu['engine']:.2f}x CPU time; "
              "per round: " + ", ".join(f"{p[0] / e[0]:.2f}" for p, e in zip(sides["plain"], sides["engine"])))

        if args.skip_train:
            print(f"\ntargets: generate at >= 70% of its GEMM peak: {share['engine']:.0%}; "
                  f"engine vs plain {args.plain_dtype}: {speedup:.2f}x")
            return
        data = write_dataset(scratch / "data", count=4, size=64)
        row = train_overhead.compare(registry, args.train_family, scratch, data, args.train_steps, args.rounds)
        print(f"\ntrainer ({args.train_family}, tiny, 64 px): engine {row['engine_it_s']:.2f} it/s, plain peft loop "
              f"{row['plain_it_s']:.2f} it/s: {row['ratio']:.3f} (CPU-s a step {row['engine_cpu_s']:.4f} vs "
              f"{row['plain_cpu_s']:.4f}); per round: " + ", ".join(f"{r:.3f}" for r in row["rounds"]))

    print("\ntargets: " + "; ".join([
        f"generate at >= 70% of its GEMM peak: {share['engine']:.0%} {'met' if share['engine'] >= 0.7 else 'MISSED'}",
        f">= 1.5x plain fp32: {speedup:.2f}x {'met' if speedup >= 1.5 else 'MISSED'}",
        f"trainer >= 1.0: {row['ratio']:.3f} {'met' if row['ratio'] >= 1.0 else 'MISSED'}",
    ]))


if __name__ == "__main__":
    main()
