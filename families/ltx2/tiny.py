"""Tiny random-weight LTX-2 pipeline for fast, offline tests.

A ``diffusers.LTX2Pipeline`` of the family's real classes: the ``LTX2VideoTransformer3DModel``
(two audio-video blocks), the ``AutoencoderKLLTX2Video`` (one level: 2x in space and time, 4
channels), the ``AutoencoderKLLTX2Audio`` (mel spectrograms at 16 kHz, hop 160, 4x in time
and mel as the real one, so a clip's sound encodes to the latents the DiT reads), the
``LTX2Vocoder`` (its upsampling a hop x 1.5: 24 kHz stereo, as the real one gives), the
``LTX2TextConnectors`` and a ``Gemma3ForConditionalGeneration`` text encoder with a
character-level ``GemmaTokenizerFast`` built with ``tokenizers``. A 2-step, 9-frame, 64 px
clip with its sound renders in seconds on the CPU.
"""

from __future__ import annotations

import pathlib

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from engine.testing.tiny_tokenizers import gemma_char_tokenizer
from families.ltx2.table import AUDIO_RATE

__all__ = ["TINY_FRAMES", "TINY_RESOLUTION", "build_tiny_pipeline"]

TINY_RESOLUTION: int = 64
#: Frames of a tiny clip: the shortest on the 8k+1 lattice.
TINY_FRAMES: int = 9
_SEED = 0
#: The Gemma width, which the connectors' heads (4 x 8) and the DiT's caption channels match.
_TEXT_DIM = 32


def _text_encoder(vocab: int, pad: int) -> Gemma3ForConditionalGeneration:
    config = Gemma3Config(
        text_config={"vocab_size": vocab, "hidden_size": _TEXT_DIM, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
                     "max_position_embeddings": 256, "sliding_window": 64, "pad_token_id": pad},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8},
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(config).eval()


def build_tiny_pipeline(path: pathlib.Path) -> pathlib.Path:
    """Write a tiny ``LTX2Pipeline`` to ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma_char_tokenizer()
    torch.manual_seed(_SEED)
    text_encoder = _text_encoder(len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(_SEED)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=_TEXT_DIM, rope_double_precision=False, rope_type="split",
    )
    torch.manual_seed(_SEED)
    connectors = LTX2TextConnectors(
        caption_channels=_TEXT_DIM, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    )
    torch.manual_seed(_SEED)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    torch.manual_seed(_SEED)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )
    torch.manual_seed(_SEED)
    vocoder = LTX2Vocoder(  # 4 x 6 x 10 = 240 samples a mel frame: 100 frames a second become 24 kHz
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[8, 12, 20],
        upsample_factors=[4, 6, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=AUDIO_RATE,
    )
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(path)
    return path
