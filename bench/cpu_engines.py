"""stable-diffusion.cpp vs torch on the CPU: one FLUX.1 transformer, seconds per step and peak RSS.

The model is a slice of FLUX.1 at its real width (3072, 24 heads of 128) with
fewer blocks, written once as the files sd.cpp reads (``families/flux/sdcpp_files.py``:
the transformer as a GGUF, the autoencoder and CLIP-L beside it). Each engine
runs in a child process of its own (so its peak RSS is its own), with the same
thread count (the plan's: one per physical core), the same image size and steps:

* sd.cpp: the binding runs a text-to-image call; a step's time is what its
  progress callback reports for each denoising step;
* torch: the same file's weights converted by diffusers (BFL -> diffusers keys)
  into ``FluxTransformer2DModel`` in fp32 (the engine's CPU dtype where it
  fits), called as the pipeline calls it per step (the same token counts:
  the image's patches and 256 T5 tokens of zeros, as sd.cpp without T5).

Prints both side by side and the ratio; the target is sd.cpp >= 3x faster per
step. Medians of the steps after the first.

    .venv/bin/python bench/cpu_engines.py [--size 256] [--steps 4] [--double 1] [--single 2] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux


def run_sdcpp(files: dict[str, str], size: int, steps: int, threads: int) -> dict[str, float]:
    from stable_diffusion_cpp import StableDiffusion

    context = StableDiffusion(**files, n_threads=threads, verbose=False)
    stamps: list[float] = []

    def on_step(step: int, total: int, _seconds: float) -> None:
        if total == steps and step > 0:
            stamps.append(time.perf_counter())

    started = time.perf_counter()
    context.generate_image(prompt="a lighthouse at dusk", width=size, height=size, sample_steps=steps,
                           cfg_scale=1.0, guidance=3.5, seed=0, progress_callback=on_step)
    per_step = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"s_per_step": statistics.median(per_step), "total_s": time.perf_counter() - started}


def run_torch(files: dict[str, str], size: int, steps: int, threads: int, dtype: str = "fp32") -> dict[str, float]:
    import torch
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    torch.set_num_threads(threads)
    state = _read_transformer(files["diffusion_model_path"])
    width = state["img_in.weight"].shape[0]
    double = len({k.split(".")[1] for k in state if k.startswith("double_blocks.")})
    single = len({k.split(".")[1] for k in state if k.startswith("single_blocks.")})
    converted = convert_flux_transformer_checkpoint_to_diffusers(state)
    model = FluxTransformer2DModel(
        num_layers=double, num_single_layers=single, attention_head_dim=128, num_attention_heads=width // 128,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    )
    model.load_state_dict(converted)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model.to(torch_dtype).eval()
    side = size // 16
    latents = torch.randn(1, side * side, 64, dtype=torch_dtype)
    context = torch.zeros(1, 256, 4096, dtype=torch_dtype)
    rows = torch.arange(side).repeat_interleave(side).float()
    image_ids = torch.stack([torch.zeros(side * side), rows, torch.arange(side).repeat(side).float()], -1)
    text_ids = torch.zeros(256, 3)
    from torch.utils.flop_counter import FlopCounterMode

    def step(index: int) -> None:
        model(hidden_states=latents, encoder_hidden_states=context,
              pooled_projections=torch.zeros(1, 768, dtype=torch_dtype),
              timestep=torch.tensor([1.0 - index / steps]), guidance=torch.tensor([3.5]), img_ids=image_ids,
              txt_ids=text_ids, return_dict=False)

    times = []
    with torch.inference_mode():
        for index in range(steps):
            started = time.perf_counter()
            step(index)
            times.append(time.perf_counter() - started)
        with FlopCounterMode(display=False) as counter:  # after the timed steps: it slows the call it counts
            step(0)
    return {"s_per_step": statistics.median(times[1:] or times), "total_s": sum(times),
            "gflop_per_step": counter.get_total_flops() / 1e9}


def _read_transformer(path: str) -> dict[str, object]:
    """The transformer's tensors as torch fp32, from a GGUF (dequantised) or a safetensors."""
    import numpy as np
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(path).items()}
    import gguf

    out = {}
    for tensor in gguf.GGUFReader(path).tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        out[tensor.name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).reshape(shape))
    return out


def child(engine: str, files: dict[str, str], size: int, steps: int, threads: int,
          dtype: str = "fp32") -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", engine, "--files", json.dumps(files), "--size", str(size),
         "--steps", str(steps), "--threads", str(threads), "--torch-dtype", dtype],
        capture_output=True, text=True, check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the {engine} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=3072, help="transformer width (3072: FLUX.1's)")
    parser.add_argument("--double", type=int, default=1, help="double-stream blocks (FLUX.1 has 19)")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks (FLUX.1 has 38)")
    parser.add_argument("--threads", type=int, default=None, help="default: the plan's (one per physical core)")
    parser.add_argument("--folder", type=Path, help="write the files here and reuse them on the next run "
                        "(default: a temporary folder)")
    parser.add_argument("--torch-dtype", choices=("fp32", "bf16", "both"), default="both",
                        help="the torch side's dtype: fp32 (the engine's CPU choice where it fits), bf16 (its "
                             "choice where fp32 does not), or both")
    parser.add_argument("--child", choices=("sdcpp", "torch"))
    parser.add_argument("--files")
    args = parser.parse_args()
    if args.threads is None:
        from engine.hardware.gemm import default_threads

        args.threads = default_threads()
    if args.child:
        files = json.loads(args.files)
        if args.child == "sdcpp":
            figures = run_sdcpp(files, args.size, args.steps, args.threads)
        else:
            figures = run_torch(files, args.size, args.steps, args.threads, args.torch_dtype)
        print(json.dumps({**figures, "peak_rss_gb": peak_rss_gb()}))
        return
    from families.flux.sdcpp_files import write_tiny

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or Path(scratch)
        started = time.perf_counter()
        model = folder / "flux-tiny.gguf"
        if args.folder is not None and model.exists():  # written by an earlier run with these flags
            written = {"diffusion_model_path": model, "vae_path": folder / "ae.safetensors",
                       "clip_l_path": folder / "clip_l.safetensors"}
        else:
            written = write_tiny(folder, gguf=True, width=args.width, double_blocks=args.double,
                                 single_blocks=args.single)
        files = {k: str(v) for k, v in written.items()}
        size_gb = Path(files["diffusion_model_path"]).stat().st_size / 1e9
        print(f"FLUX.1 slice: width {args.width}, {args.double} double + {args.single} single blocks, "
              f"Q8_0 GGUF {size_gb:.2f} GB (written in {time.perf_counter() - started:.0f} s); "
              f"{args.size}x{args.size} px, {args.steps} steps, {args.threads} threads")
        sdcpp = child("sdcpp", files, args.size, args.steps, args.threads)
        dtypes = ("fp32", "bf16") if args.torch_dtype == "both" else (args.torch_dtype,)
        torch_runs = {dtype: child("torch", files, args.size, args.steps, args.threads, dtype) for dtype in dtypes}
    # The same model and token counts on both sides: a step's FLOPs, counted on the torch side.
    gflop = next(iter(torch_runs.values()))["gflop_per_step"]
    print(f"a step: {gflop:.0f} GFLOP (torch's FlopCounterMode)")
    print(f"{'engine':<24} {'s/step':>8} {'GFLOP/s':>8} {'a thread':>9} {'peak RSS GB':>12} {'sd.cpp faster':>14}")
    print(f"{'sd.cpp (Q8_0 GGUF)':<24} {sdcpp['s_per_step']:>8.3f} {gflop / sdcpp['s_per_step']:>8.1f} "
          f"{gflop / sdcpp['s_per_step'] / args.threads:>9.1f} {sdcpp['peak_rss_gb']:>12.2f}")
    for dtype, run in torch_runs.items():
        print(f"{f'torch ({dtype}, diffusers)':<24} {run['s_per_step']:>8.3f} {gflop / run['s_per_step']:>8.1f} "
              f"{gflop / run['s_per_step'] / args.threads:>9.1f} {run['peak_rss_gb']:>12.2f} "
              f"{run['s_per_step'] / sdcpp['s_per_step']:>13.2f}x")
    print("target: sd.cpp >= 3x faster per step than the torch path the engine would take")


if __name__ == "__main__":
    main()
