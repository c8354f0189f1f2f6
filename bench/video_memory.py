"""A video plan's headroom against the bytes a clip really holds: Wan 2.2 TI2V-5B, counted.

The plan reserves, beside a video model's weights, the earlier system's starting rule:
4 GiB plus three fp32 copies of the clip (engine.policy.activations.video_overhead_gb).
This measures what a clip holds at its peak, at TI2V-5B's real widths, under torch's
``FakeTensorMode`` (every op at its real shape and dtype, nothing computed) with the
training tool's byte counter (``LiveBytes``): one denoiser forward (bf16; the blocks run
one at a time, so two blocks stand for thirty) and the VAE's tiled fp32 decode of the
clip's latents. Printed: each, the larger plus the 1 GiB context, the plan's figure and
their ratio (target: within 10%).

    .venv/bin/python bench/video_memory.py [--clips 33x640x352 121x1280x704]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware.profile import GIB_IN_GB  # noqa: E402
from engine.policy.activations import ImageShape, video_overhead_gb  # noqa: E402
from engine.testing.memory_measure import LiveBytes  # noqa: E402

#: Wan 2.2 TI2V-5B's DiT (30 x 3072, UMT5's 4096-wide text) and its 16x, 48-channel VAE.
DIT = {"num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48, "out_channels": 48,
       "text_dim": 4096, "ffn_dim": 14336, "num_layers": 2, "freq_dim": 256, "patch_size": [1, 2, 2]}
VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
       "temperal_downsample": [False, True, True], "is_residual": True, "patch_size": 2, "in_channels": 12,
       "out_channels": 12, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
       "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}


def measure(frames: int, width: int, height: int) -> tuple[int, int]:
    """Peak live bytes of one denoiser forward and of the tiled VAE decode."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    latent = (1, 48, (frames - 1) // 4 + 1, height // 16, width // 16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)  # built in bf16 (a fake module cannot be cast)
        try:
            dit = WanTransformer3DModel(**DIT).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        x = torch.randn(latent, dtype=torch.bfloat16)
        text = torch.randn(1, 512, 4096, dtype=torch.bfloat16)
        t = torch.tensor([500.0])
        with torch.inference_mode(), LiveBytes() as counter:
            dit(hidden_states=x, encoder_hidden_states=text, timestep=t, return_dict=False)
        denoiser = counter.peak
        vae = AutoencoderKLWan(**VAE).eval()
        vae.enable_tiling()
        z = torch.randn(latent)
        with torch.inference_mode(), LiveBytes() as counter:
            vae.decode(z, return_dict=False)
        decode = counter.peak
    return denoiser, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", nargs="*", default=["33x640x352", "121x1280x704"])
    args = parser.parse_args()
    registry = load_registry()
    registry.family("wan")  # the family this measures is installed
    print(f"{'clip':<14} {'denoiser GB':>11} {'VAE decode GB':>13} {'held GB':>8} {'plan GB':>8} {'plan/held':>9}")
    for clip in args.clips:
        frames, width, height = (int(v) for v in clip.split("x"))
        denoiser, decode = measure(frames, width, height)
        held = max(denoiser, decode) / 1e9 + 1 * GIB_IN_GB
        plan, _ = video_overhead_gb(ImageShape(width, height, 1, frames=frames), 0.0)
        print(f"{clip:<14} {denoiser / 1e9:>11.2f} {decode / 1e9:>13.2f} {held:>8.2f} {plan:>8.2f} "
              f"{plan / held:>9.2f}")


if __name__ == "__main__":
    main()
