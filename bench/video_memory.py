"""A video plan's headroom against the bytes a Wan clip really holds, counted.

The plan reserves, beside a video model's weights, the larger of one denoiser
forward over the clip's tokens and the VAE's tiled decode, plus a 1 GiB context
(:func:`engine.policy.activations.video_overhead_gb`, from the checkpoint's
``VideoSpec.memory`` figures). This measures what a clip holds at its peak, at the
checkpoint's real widths, under torch's ``FakeTensorMode`` (every op at its real shape
and dtype, nothing computed) with the training tool's byte counter (``LiveBytes``):
one bf16 denoiser forward (the blocks run one at a time, so two blocks stand for
thirty or forty) and the VAE's tiled fp32 decode of the clip's latents. Printed: each,
the larger plus the context, the plan's figure and their ratio (target: within 10%).

``--derive`` prints the figures the table carries, measured: the denoiser's elements
per latent token (the slope between two clips) and one tile's decoder working set
(a clip's decode peak less the tile outputs it holds).

    .venv/bin/python bench/video_memory.py [--checkpoint wan2.2-ti2v-5b] [--clips 33x640x352 ...]
    .venv/bin/python bench/video_memory.py --derive [--checkpoint wan2.1-t2v-14b]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from engine.contract.plugins import load_registry  # noqa: E402
from engine.hardware.profile import GIB_IN_GB  # noqa: E402
from engine.policy.activations import RGB, ImageShape, tiled_px, video_overhead_gb  # noqa: E402
from engine.testing.memory_measure import LiveBytes  # noqa: E402

_DIT = {"attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, "num_layers": 2, "patch_size": [1, 2, 2]}
#: Wan 2.2's 16x, 48-channel VAE (TI2V-5B) and Wan 2.1's 8x, 16-channel one (every other checkpoint).
_VAE22 = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
          "temperal_downsample": [False, True, True], "is_residual": True, "patch_size": 2, "in_channels": 12,
          "out_channels": 12, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
          "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}
_VAE21: dict[str, object] = {}


@dataclass(frozen=True)
class Case:
    """One checkpoint's denoiser and VAE at their published widths."""

    dit: dict[str, object]
    vae: dict[str, object]
    channels: int
    compression: int
    clips: tuple[str, ...]
    derive: tuple[str, str] = field(default=("33x640x352", "81x640x352"))


CASES = {
    "wan2.2-ti2v-5b": Case({**_DIT, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                            "ffn_dim": 14336}, _VAE22, 48, 16,
                           ("33x640x352", "81x640x352", "121x640x352", "33x1280x704", "81x832x480", "121x1280x704")),
    "wan2.1-t2v-14b": Case({**_DIT, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16,
                            "ffn_dim": 13824}, _VAE21, 16, 8, ("33x832x480", "81x832x480", "81x1280x720")),
    "wan2.1-t2v-1.3b": Case({**_DIT, "num_attention_heads": 12, "in_channels": 16, "out_channels": 16,
                             "ffn_dim": 8960}, _VAE21, 16, 8, ("33x832x480", "81x832x480")),
}


def _clip(text: str) -> tuple[int, int, int]:
    frames, width, height = (int(v) for v in text.split("x"))
    return frames, width, height


def measure(case: Case, frames: int, width: int, height: int) -> tuple[int, int]:
    """Peak live bytes of one denoiser forward and of the tiled VAE decode."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    latent = (1, case.channels, (frames - 1) // 4 + 1, height // case.compression, width // case.compression)
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)  # built in bf16 (a fake module cannot be cast)
        try:
            dit = WanTransformer3DModel(**case.dit).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        x = torch.randn(latent, dtype=torch.bfloat16)
        text = torch.randn(1, 512, 4096, dtype=torch.bfloat16)
        with torch.inference_mode(), LiveBytes() as counter:
            dit(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([500.0]), return_dict=False)
        denoiser = counter.peak
        vae = AutoencoderKLWan(**case.vae).eval()
        vae.enable_tiling()
        with torch.inference_mode(), LiveBytes() as counter:
            vae.decode(torch.randn(latent), return_dict=False)
        decode = counter.peak
    return denoiser, decode


def check(name: str, clips: list[str]) -> None:
    registry = load_registry()
    family = registry.family("wan")
    checkpoint = next(c for c in family.checkpoints if c.name == name)
    case = CASES[name]
    print(f"{name}: counted under fake tensors against the plan's figure")
    print(f"{'clip':<14} {'denoiser GB':>11} {'VAE decode GB':>13} {'held GB':>8} {'plan GB':>8} {'plan/held':>9}")
    for clip in clips or case.clips:
        frames, width, height = _clip(clip)
        denoiser, decode = measure(case, frames, width, height)
        held = max(denoiser, decode) / 1e9 + 1 * GIB_IN_GB
        plan, _ = video_overhead_gb(family, checkpoint, ImageShape(width, height, 1, frames=frames), 2, 0.0)
        print(f"{clip:<14} {denoiser / 1e9:>11.2f} {decode / 1e9:>13.2f} {held:>8.2f} {plan:>8.2f} "
              f"{plan / held:>9.2f}")


def derive(name: str) -> None:
    registry = load_registry()
    checkpoint = next(c for c in registry.family("wan").checkpoints if c.name == name)
    memory = (checkpoint.video or registry.family("wan").rendering.video).memory  # type: ignore[union-attr]
    case = CASES[name]
    points = []
    for clip in case.derive:
        frames, width, height = _clip(clip)
        denoiser, decode = measure(case, frames, width, height)
        side = case.compression * 2
        tokens = ((frames - 1) // 4 + 1) * (width // side) * (height // side)
        points.append((tokens, denoiser, decode, frames, width, height))
    (t0, d0, *_), (t1, d1, *_) = points
    per_token = (d1 - d0) / (t1 - t0) / 2  # bf16 bytes -> elements
    assert memory is not None, "the table has no VideoMemory to compare with"
    # The working set beside the tile outputs, the larger of the two clips' (fp32 bytes -> elements).
    tile_elements = max(
        decode / 4 - tiled_px(w, case.compression, memory) * tiled_px(h, case.compression, memory) * f * RGB
        for _, _, decode, f, w, h in points
    )
    print(f"{name}: VideoMemory(denoiser_per_token={per_token:.4g}, decode_tile_elements={tile_elements:.4g})"
          f"  (table: {memory.denoiser_per_token:.4g}, {memory.decode_tile_elements:.4g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", choices=sorted(CASES), default="wan2.2-ti2v-5b")
    parser.add_argument("--clips", nargs="*", default=[])
    parser.add_argument("--derive", action="store_true", help="print the figures the table carries, measured")
    args = parser.parse_args()
    if args.derive:
        derive(args.checkpoint)
    else:
        check(args.checkpoint, args.clips)


if __name__ == "__main__":
    main()
