"""Tiny random-weight FLUX.1 files in the layouts stable-diffusion.cpp reads.

sd.cpp does not read diffusers folders for FLUX: it takes the original
single files (what people download beside a GGUF): the transformer in Black
Forest Labs' layout (``double_blocks.N.img_attn.qkv``...), the autoencoder
``ae.safetensors`` in the original (ldm) layout, and CLIP-L in the
transformers layout. It infers the transformer's depth and width from the
tensor shapes, but its CLIP-L and its autoencoder have fixed widths and its
T5-XXL reader takes only the full 4.7 B model. So these files are:

* transformer: 1 double + 1 single block at width 256 (2 heads of 128: the
  rope axes ``(16, 56, 56)`` fix the head width), guidance embedding (dev);
  as ``.safetensors`` (f16) or ``.gguf`` (Q8_0, the quantised kind people run);
* ``ae.safetensors``: the real 16-channel autoencoder shape (84 M parameters);
* ``clip_l.safetensors``: the real CLIP-L text model shape (123 M parameters);
* no T5: sd.cpp then runs with an all-zero T5 context (prompt adherence
  degraded, which a random model does not have anyway).

Numpy only (no torch): the weights are seeded, so two builds are identical.
The same files load into diffusers (``FluxTransformer2DModel.from_single_file``),
which is how ``bench/cpu_engines.py`` runs one model through both engines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

#: Transformer width and head width of the tiny file (head 128: the rope axes need it).
WIDTH = 256
HEAD_DIM = 128
#: FLUX's text context width (T5-XXL) and pooled CLIP width: the reader sizes zeros by them.
CONTEXT_DIM = 4096
POOLED_DIM = 768
MLP_RATIO = 4


def write_tiny(folder: str | Path, *, gguf: bool = False, width: int = WIDTH,
               double_blocks: int = 1, single_blocks: int = 1, companions: bool = True) -> dict[str, Path]:
    """Write the transformer, ``ae.safetensors`` and ``clip_l.safetensors`` into ``folder``.

    Returns the files by the binding's argument names (``diffusion_model_path``,
    ``vae_path``, ``clip_l_path``). ``width``/``*_blocks`` grow the transformer
    (the benchmark runs a real-width slice of FLUX.1); ``companions=False`` writes the
    transformer alone (the two companions are real-shape: 400 MB)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    model = folder / ("flux-tiny.gguf" if gguf else "flux-tiny.safetensors")
    tensors = transformer_tensors(rng, width, double_blocks, single_blocks)
    if gguf:
        _save_gguf(tensors, model)
    else:
        _save_safetensors(tensors, model)
    if not companions:
        return {"diffusion_model_path": model}
    vae = folder / "ae.safetensors"
    clip = folder / "clip_l.safetensors"
    if not vae.exists():
        _save_safetensors(autoencoder_tensors(np.random.default_rng(1)), vae)
    if not clip.exists():
        _save_safetensors(clip_l_tensors(np.random.default_rng(2)), clip)
    return {"diffusion_model_path": model, "vae_path": vae, "clip_l_path": clip}


def _weights(rng: np.random.Generator) -> Callable[..., np.ndarray]:
    """Seeded normal weights, drawn once as a pool and tiled: a random model needs no more,
    and drawing 200 M fresh values would take seconds of every test that writes one."""
    pool = rng.standard_normal(1 << 20, dtype=np.float32).astype(np.float16)

    def make(*shape: int, scale: float = 0.02) -> np.ndarray:
        start = int(rng.integers(0, pool.size // 2))  # each tensor tiles the pool from its own place
        return np.resize(pool[start:], shape) * np.float16(scale)

    return make


def transformer_tensors(rng: np.random.Generator, width: int, double_blocks: int,
                        single_blocks: int) -> dict[str, np.ndarray]:
    """FLUX.1-dev's transformer in Black Forest Labs' key layout."""
    w = _weights(rng)
    out: dict[str, np.ndarray] = {}
    mlp = MLP_RATIO * width

    def linear(name: str, rows: int, cols: int) -> None:
        out[f"{name}.weight"] = w(rows, cols)
        out[f"{name}.bias"] = np.zeros(rows, np.float16)

    def qk_norm(prefix: str) -> None:
        for which in ("query_norm", "key_norm"):
            out[f"{prefix}.{which}.scale"] = np.ones(HEAD_DIM, np.float16)

    linear("img_in", width, 64)
    linear("txt_in", width, CONTEXT_DIM)
    for name, inputs in (("time_in", 256), ("vector_in", POOLED_DIM), ("guidance_in", 256)):
        linear(f"{name}.in_layer", width, inputs)
        linear(f"{name}.out_layer", width, width)
    for index in range(double_blocks):
        for stream in ("img", "txt"):
            prefix = f"double_blocks.{index}.{stream}"
            linear(f"{prefix}_mod.lin", 6 * width, width)
            linear(f"{prefix}_attn.qkv", 3 * width, width)
            linear(f"{prefix}_attn.proj", width, width)
            qk_norm(f"{prefix}_attn.norm")
            linear(f"{prefix}_mlp.0", mlp, width)
            linear(f"{prefix}_mlp.2", width, mlp)
    for index in range(single_blocks):
        prefix = f"single_blocks.{index}"
        linear(f"{prefix}.linear1", 3 * width + mlp, width)
        linear(f"{prefix}.linear2", width, width + mlp)
        linear(f"{prefix}.modulation.lin", 3 * width, width)
        qk_norm(f"{prefix}.norm")
    linear("final_layer.linear", 64, width)
    linear("final_layer.adaLN_modulation.1", 2 * width, width)
    return out


def autoencoder_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """FLUX.1's 16-channel autoencoder (``ae.safetensors``) in the original layout."""
    w = _weights(rng)
    out: dict[str, np.ndarray] = {}

    def conv(name: str, rows: int, cols: int, kernel: int = 3) -> None:
        out[f"{name}.weight"] = w(rows, cols, kernel, kernel)
        out[f"{name}.bias"] = np.zeros(rows, np.float16)

    def norm(name: str, channels: int) -> None:
        out[f"{name}.weight"] = np.ones(channels, np.float16)
        out[f"{name}.bias"] = np.zeros(channels, np.float16)

    def resnet(name: str, cin: int, cout: int) -> None:
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cout, cin)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cout, cin, 1)

    def middle(side: str, channels: int) -> None:
        resnet(f"{side}.mid.block_1", channels, channels)
        norm(f"{side}.mid.attn_1.norm", channels)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{side}.mid.attn_1.{part}", channels, channels, 1)
        resnet(f"{side}.mid.block_2", channels, channels)

    base, mult, latent = 128, (1, 2, 4, 4), 16
    conv("encoder.conv_in", base, 3)
    channels = base
    for level, factor in enumerate(mult):
        for block in range(2):
            resnet(f"encoder.down.{level}.block.{block}", channels, base * factor)
            channels = base * factor
        if level != len(mult) - 1:
            conv(f"encoder.down.{level}.downsample.conv", channels, channels)
    middle("encoder", channels)
    norm("encoder.norm_out", channels)
    conv("encoder.conv_out", 2 * latent, channels)
    conv("decoder.conv_in", channels, latent)
    middle("decoder", channels)
    for level in reversed(range(len(mult))):
        for block in range(3):
            resnet(f"decoder.up.{level}.block.{block}", channels, base * mult[level])
            channels = base * mult[level]
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", channels, channels)
    norm("decoder.norm_out", channels)
    conv("decoder.conv_out", 3, channels)
    return out


def clip_l_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """CLIP ViT-L/14's text model in the transformers layout (12 layers of 768)."""
    w = _weights(rng)
    width, hidden, layers = 768, 3072, 12
    prefix = "text_model."
    out = {
        f"{prefix}embeddings.token_embedding.weight": w(49408, width),
        f"{prefix}embeddings.position_embedding.weight": w(77, width),
        f"{prefix}final_layer_norm.weight": np.ones(width, np.float16),
        f"{prefix}final_layer_norm.bias": np.zeros(width, np.float16),
    }
    for layer in range(layers):
        block = f"{prefix}encoder.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{block}self_attn.{name}.weight"] = w(width, width)
            out[f"{block}self_attn.{name}.bias"] = np.zeros(width, np.float16)
        for name in ("layer_norm1", "layer_norm2"):
            out[f"{block}{name}.weight"] = np.ones(width, np.float16)
            out[f"{block}{name}.bias"] = np.zeros(width, np.float16)
        out[f"{block}mlp.fc1.weight"] = w(hidden, width)
        out[f"{block}mlp.fc1.bias"] = np.zeros(hidden, np.float16)
        out[f"{block}mlp.fc2.weight"] = w(width, hidden)
        out[f"{block}mlp.fc2.bias"] = np.zeros(width, np.float16)
    return out


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _save_gguf(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Matrices as Q8_0 (the GGUF people run on CPUs), vectors as f32, as city96's files do."""
    from engine.testing.gguf_files import write_gguf_arrays

    write_gguf_arrays(tensors, path, arch="flux")
