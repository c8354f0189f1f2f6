"""Tiny random-weight SDXL pipeline for tests (no hub access needed).

It uses the real SDXL base parts (``UNet2DConditionModel`` with
``addition_embed_type="text_time"`` and a plain ``DownBlock2D`` first level
followed by cross-attention levels, CLIP-L-like ``CLIPTextModel`` and
CLIP-G-like ``CLIPTextModelWithProjection`` whose penultimate hidden states
are concatenated into the cross-attention input, a 4-channel ``AutoencoderKL``
with SDXL's scaling factor, and SDXL's ``EulerDiscreteScheduler`` settings),
shrunk so that a 2-step 64x64 generate takes a fraction of a second on CPU:

* UNet: three levels of 32/64/128 channels, one resnet and one transformer
  layer per level, ``cross_attention_dim`` 96 (= 32 + 64 text hidden sizes),
  ``sample_size`` 8 so the pipeline's default size is 64x64.
  The time embedding is 512 wide (like SDXL's 1280 = 4 x 320) and the added
  "text_time" input is 6 x 64 + 128 = 512, so ``time_embedding.linear_2``,
  ``add_embedding.linear_1`` and ``add_embedding.linear_2`` are 512x512
  ``Linear`` layers that int8 filters skipping layers under 512 features can
  still quantise. The attention projections stay small on purpose: in a UNet
  their width is the level's channel count, and a 512-channel level (with its
  3x3 convs) costs ~45M parameters (~180 MB), far more than a tiny pipeline
  should;
* VAE: four blocks (scale factor 8, like the real VAE), 32/64 channels;
* text encoders: 2-layer CLIPs (hidden size 32, and 64 with a 128 projection);
* tokenizers: built locally with ``tokenizers``: a byte-level CLIP BPE over
  the 256 byte symbols with no merges (``CLIPTokenizer``), so each prompt is
  split into characters and distinct prompts give distinct ids. Both pad with
  ``<|endoftext|>`` (SDXL's ``tokenizer_2`` pads with ``!``, but a special
  ``!`` pad token would swallow every ``!`` typed in a prompt).

Weights are seeded with ``torch.manual_seed(0)`` before each model, so two
builds are identical.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
)

# Height/width that works: 8x VAE downsampling, then two 2x UNet downsamples,
# so sizes should be multiples of 32. It is also the pipeline's default size.
TINY_RESOLUTION: int = 64

# Extra kwargs for ``pipe(...)``; none are needed, the default guidance works.
TINY_GENERATE_KWARGS: dict[str, Any] = {"guidance_scale": 5.0}

_SEED: int = 0
_CLIP_MAX_LENGTH: int = 77
_TEXT_HIDDEN: int = 32
_TEXT_2_HIDDEN: int = 64
_TEXT_2_PROJECTION: int = 128
_ADDITION_TIME_EMBED_DIM: int = 64
_LATENT_CHANNELS: int = 4


def _clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP BPE over the 256 byte symbols (plus their ``</w>`` forms), no merges."""
    alphabet: list[str] = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    for symbol in alphabet:
        vocab[symbol + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_CLIP_MAX_LENGTH)


def _clip_config(
    tokenizer: CLIPTokenizer, hidden_size: int, projection_dim: int, hidden_act: str
) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    config = _clip_config(tokenizer, _TEXT_HIDDEN, _TEXT_HIDDEN, "quick_gelu")
    torch.manual_seed(_SEED)
    return CLIPTextModel(config).eval()


def _text_encoder_2(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = _clip_config(tokenizer, _TEXT_2_HIDDEN, _TEXT_2_PROJECTION, "gelu")
    torch.manual_seed(_SEED)
    return CLIPTextModelWithProjection(config).eval()


#: The UNet's down path and conditioning, which its ControlNet repeats.
_DOWN_PATH: dict[str, object] = {
    "in_channels": _LATENT_CHANNELS,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "block_out_channels": (32, 64, 128),
    "layers_per_block": 1,
    "transformer_layers_per_block": (1, 1, 1),
    "attention_head_dim": (2, 4, 8),
    "norm_num_groups": 32,
    "cross_attention_dim": _TEXT_HIDDEN + _TEXT_2_HIDDEN,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": _ADDITION_TIME_EMBED_DIM,
    "projection_class_embeddings_input_dim": 6 * _ADDITION_TIME_EMBED_DIM + _TEXT_2_PROJECTION,
}


def _unet() -> UNet2DConditionModel:
    torch.manual_seed(_SEED)
    return UNet2DConditionModel(
        sample_size=TINY_RESOLUTION // 8,
        out_channels=_LATENT_CHANNELS,
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        time_embedding_dim=512,
        **_DOWN_PATH,
    ).eval()


def _vae() -> AutoencoderKL:
    torch.manual_seed(_SEED)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=TINY_RESOLUTION,
        scaling_factor=0.13025,
        force_upcast=True,
    ).eval()


def _scheduler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        interpolation_type="linear",
        use_karras_sigmas=False,
        timestep_spacing="leading",
        steps_offset=1,
    )


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight ``StableDiffusionXLPipeline`` to ``path`` (created) and return ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _clip_tokenizer()
    tokenizer_2 = _clip_tokenizer()
    pipeline = StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        text_encoder_2=_text_encoder_2(tokenizer_2),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=_unet(),
        scheduler=_scheduler(),
        add_watermarker=False,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


# -- the whole pipeline as one original-layout checkpoint ---------------------------------

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))
_VAE_RESNET = (("conv_shortcut", "nin_shortcut"),)
_VAE_ATTENTION = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))


def _rename(rest: str, rules: tuple[tuple[str, str], ...]) -> str:
    for new, old in rules:
        if rest.startswith(new + "."):
            return old + rest[len(new):]
    return rest


def _unet_key(key: str, layers: int, attention_levels: set[int]) -> str:
    """The SGM (``model.diffusion_model.``) name of a diffusers UNet key."""
    fixed = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
    for new, old in fixed.items():
        if key.startswith(new + "."):
            return old + key[len(new):]
    parts = key.split(".")
    if parts[0] == "down_blocks":
        level, kind = int(parts[1]), parts[2]
        if kind == "downsamplers":
            return f"input_blocks.{(level + 1) * (layers + 1)}.0.op." + ".".join(parts[5:])
        index = 1 + level * (layers + 1) + int(parts[3])
        rest = ".".join(parts[4:])
        return f"input_blocks.{index}.0.{_rename(rest, _RESNET)}" if kind == "resnets" else f"input_blocks.{index}.1.{rest}"
    if parts[0] == "mid_block":
        rest = ".".join(parts[3:])
        if parts[1] == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * int(parts[2])}.{_rename(rest, _RESNET)}"
    if parts[0] == "up_blocks":
        level, kind = int(parts[1]), parts[2]
        if kind == "upsamplers":
            slot = 2 if level in attention_levels else 1
            return f"output_blocks.{level * (layers + 1) + layers}.{slot}." + ".".join(parts[4:])
        index = level * (layers + 1) + int(parts[3])  # an up level has layers + 1 resnets
        rest = ".".join(parts[4:])
        return f"output_blocks.{index}.0.{_rename(rest, _RESNET)}" if kind == "resnets" else f"output_blocks.{index}.1.{rest}"
    raise KeyError(key)


def _vae_key(key: str, levels: int) -> tuple[str, bool]:
    """The original VAE name of a diffusers key, and whether it is a mid-attention
    Linear (stored as a 1x1 convolution there)."""
    parts = key.split(".")
    side = parts[0]
    if len(parts) > 1 and parts[1] in ("down_blocks", "up_blocks"):
        level = int(parts[2]) if parts[1] == "down_blocks" else levels - 1 - int(parts[2])
        group = "down" if parts[1] == "down_blocks" else "up"
        if parts[3] in ("downsamplers", "upsamplers"):
            which = "downsample" if parts[3] == "downsamplers" else "upsample"
            return f"{side}.{group}.{level}.{which}." + ".".join(parts[5:]), False
        return f"{side}.{group}.{level}.block.{parts[4]}." + _rename(".".join(parts[5:]), _VAE_RESNET), False
    if len(parts) > 1 and parts[1] == "mid_block":
        if parts[2] == "attentions":
            rest = _rename(".".join(parts[4:]), _VAE_ATTENTION)
            return f"{side}.mid.attn_1.{rest}", rest.split(".")[0] in ("q", "k", "v", "proj_out")
        return f"{side}.mid.block_{int(parts[3]) + 1}." + _rename(".".join(parts[4:]), _VAE_RESNET), False
    return key.replace("conv_norm_out", "norm_out"), False


def write_original_checkpoint(pipeline_dir: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """``target``: the tiny pipeline's UNet, both text encoders and VAE in one
    ``.safetensors`` with the original (SGM) key layout, the file people
    download as ``sd_xl_base_1.0.safetensors``; diffusers' ``from_single_file``
    converts it back."""
    import json

    from safetensors.torch import load_file, save_file

    def weights(name: str) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for file in sorted((pipeline_dir / name).glob("*.safetensors")):
            state.update(load_file(file))
        return state

    unet_config = json.loads((pipeline_dir / "unet" / "config.json").read_text())
    attention = {len(unet_config["up_block_types"]) - 1 - i for i, kind in enumerate(unet_config["down_block_types"])
                 if kind.startswith("CrossAttn")}
    out: dict[str, torch.Tensor] = {}
    for key, value in weights("unet").items():
        out["model.diffusion_model." + _unet_key(key, unet_config["layers_per_block"], attention)] = value
    levels = len(json.loads((pipeline_dir / "vae" / "config.json").read_text())["down_block_types"])
    for key, value in weights("vae").items():
        name, linear = _vae_key(key, levels)
        out["first_stage_model." + name] = value[..., None, None] if linear and value.ndim == 2 else value
    for key, value in weights("text_encoder").items():  # transformers >= 5.6 saves CLIPTextModel flat
        named = key if key.startswith("text_model.") or key.startswith("text_projection") else "text_model." + key
        out["conditioner.embedders.0.transformer." + named] = value
    prefix = "conditioner.embedders.1.model."
    clip = weights("text_encoder_2")
    layers = sorted({int(k.split(".")[3]) for k in clip if k.startswith("text_model.encoder.layers.")})
    for i in layers:
        src, dst = f"text_model.encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[dst + f"attn.in_proj_{kind}"] = torch.cat(
                [clip[src + f"self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")]
            )
            out[dst + f"attn.out_proj.{kind}"] = clip[src + f"self_attn.out_proj.{kind}"]
            out[dst + f"ln_1.{kind}"] = clip[src + f"layer_norm1.{kind}"]
            out[dst + f"ln_2.{kind}"] = clip[src + f"layer_norm2.{kind}"]
            out[dst + f"mlp.c_fc.{kind}"] = clip[src + f"mlp.fc1.{kind}"]
            out[dst + f"mlp.c_proj.{kind}"] = clip[src + f"mlp.fc2.{kind}"]
    out[prefix + "token_embedding.weight"] = clip["text_model.embeddings.token_embedding.weight"]
    out[prefix + "positional_embedding"] = clip["text_model.embeddings.position_embedding.weight"]
    out[prefix + "ln_final.weight"] = clip["text_model.final_layer_norm.weight"]
    out[prefix + "ln_final.bias"] = clip["text_model.final_layer_norm.bias"]
    out[prefix + "text_projection"] = clip["text_projection.weight"].T.contiguous()
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(target))
    return target


def build_tiny_controlnet(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny random-weight SDXL ``ControlNetModel`` (the tiny UNet's down
    path and conditioning, an 8x conditioning embedder) to ``path``."""
    from diffusers import ControlNetModel

    torch.manual_seed(_SEED)
    controlnet = ControlNetModel(
        conditioning_embedding_out_channels=(16, 16, 32, 32),
        **_DOWN_PATH,
    ).eval()
    # A new ControlNet's output convolutions start at zero (training grows the
    # control from nothing); random ones make the tiny model steer the image.
    zeroed = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
              controlnet.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zeroed:
            conv.weight.normal_(0.0, 0.2)
    controlnet.save_pretrained(path, safe_serialization=True)
    return pathlib.Path(path)
