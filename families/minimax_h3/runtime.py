"""MiniMax-H3's torch code for the generic LoRA trainer loop: clips trained with their sound.

The loop owns noise, the sigma draw and the flow-matching target; this module owns what only
MiniMax-H3 knows, through its modular pipeline's own functions so a LoRA sees at training
time what the blocks feed the transformer at inference:

* prompts: the prompt's tokens (no template, no special tokens) through the Qwen3-VL
  conditioner's hidden state 50 (``get_qwen3vl_prompt_embeds``), one length per prompt:
  the packed sequence carries no padding, so each prompt's rows are its own (lengths kept
  beside the zero-padded table);
* clips: ``[B, 3, F, H, W]`` pixels in [-1, 1] as the uint8 frames the blocks encode a
  condition from (``encode_vae_condition``: ImageNet-normalised, the posterior drawn under
  the model's fixed seed, normalised by the VAE's latent mean and std), ``17n + 5`` frames
  into ``5n + 2`` latent frames;
* sound: ``[2, n]`` samples at 32 kHz through the audio VAE (each stereo channel a batch
  item, as the decode block splits them), its posterior mean normalised as the decode block
  un-normalises it: ``[2, C, T]``, 40 latents a second;
* the model call: one packed sequence per example (``build_packed_sequence``: text, target
  audio, target video; the rows' timesteps by ``build_row_timesteps``), the picture at
  ``t = 1 - sigma`` and the sound at its own. The transformer predicts a data-ward velocity
  (``x0 - noise``, what ``MiniMaxH3Scheduler`` steps with); the loop's target is
  ``noise - x0``, so both are returned negated.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition, get_qwen3vl_prompt_embeds


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``prompt_embeds`` [B, longest, D] (zero rows past each prompt) and each ``prompt_length`` [B]."""
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = pipe.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            rows.append(get_qwen3vl_prompt_embeds(pipe.text_encoder, pipe.processor, tokens,
                                                  text_encoder_layer=pipe.text_encoder_layer, device=device,
                                                  dtype=dtype)[0])
    longest = max(row.shape[0] for row in rows)
    table = torch.zeros(len(rows), longest, rows[0].shape[-1], device=device, dtype=dtype)
    for index, row in enumerate(rows):
        table[index, :row.shape[0]] = row
    return {"prompt_embeds": table, "prompt_length": torch.tensor([row.shape[0] for row in rows], device=device)}


def encode_images(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, C, f, h, w] for pixels [B, 3, F, H, W] (or one frame [B, 3, H, W]) in [-1, 1]."""
    clip = pixels.unsqueeze(2) if pixels.dim() == 4 else pixels
    frames = ((clip.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    with torch.no_grad():
        latents = [encode_vae_condition(pipe.vae, frames[index:index + 1], pipe.pixel_mean, pipe.pixel_std,
                                        pipe.keyframe_encode_seed) for index in range(frames.shape[0])]
    return torch.cat(latents).to(pixels.device)


def encode_sound(pipe: Any, samples: torch.Tensor) -> torch.Tensor:
    """Normalised audio latents [channels, C, T] for one track [channels, n] in [-1, 1] at 32 kHz."""
    vae = pipe.audio_vae
    with torch.no_grad():
        latents = vae.encode(samples[:, None, :].to(vae.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1)
    return (latents - mean) / std


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The picture's velocity alone: its sound rows pure noise at sigma 1 (nothing heard)."""
    batch = noisy_latents.shape[0]
    latents = int(round(_seconds(pipe, noisy_latents.shape[2]) * LATENTS_PER_SECOND))
    silence = torch.randn(batch, pipe.audio_channels, pipe.audio_latent_channels, latents,
                          device=noisy_latents.device, dtype=noisy_latents.dtype)
    video, _ = predict_with_sound(pipe, denoiser, noisy_latents, silence, timesteps, torch.ones_like(timesteps),
                                  conditioning)
    return video


#: The audio VAE's latent rate (800-sample hops at 32 kHz).
LATENTS_PER_SECOND = 40


def _seconds(pipe: Any, latent_frames: int) -> float:
    """A clip's length from its latent frames (``5n + 2`` of them for ``17n + 5`` frames; one: a still)."""
    if latent_frames < 2:
        return 1 / pipe.fps
    chunks = (latent_frames - 2) // pipe.vae_latents_per_chunk
    return (chunks * pipe.vae_frames_per_chunk + pipe.vae_latents_per_chunk) / pipe.fps


def predict_with_sound(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, noisy_sound: torch.Tensor,
                       timesteps: torch.Tensor, sound_timesteps: torch.Tensor,
                       conditioning: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both velocities (``noise - x0``) for ``noisy_latents`` [B, C, f, h, w] at sigmas ``timesteps``
    and ``noisy_sound`` [B, 2, C, T] at ``sound_timesteps``: one packed sequence per example (its
    timesteps are the layout's, shared by a batch row)."""
    videos, sounds = [], []
    for index in range(noisy_latents.shape[0]):
        video, sound = _one(pipe, denoiser, noisy_latents[index:index + 1], noisy_sound[index],
                            float(timesteps[index]), float(sound_timesteps[index]),
                            conditioning["prompt_embeds"][index, :int(conditioning["prompt_length"][index])])
        videos.append(video)
        sounds.append(sound)
    return torch.cat(videos), torch.stack(sounds)


def _one(pipe: Any, denoiser: Any, latents: torch.Tensor, sound: torch.Tensor, sigma: float, sound_sigma: float,
         text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, channels, frames, height, width = latents.shape
    tracks, sound_channels, length = sound.shape
    tags = torch.full((text.shape[0],), pipe.text_tag, dtype=torch.long)
    position_ids, token_tags, video_indices, audio_indices, text_indices, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, frames, height, width, length, pipe.patch_size, tracks,
                                                         pipe.audio_tag, pipe.video_tag))
    unique, row_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, 0, 0, text.shape[0], 1.0 - sigma, 1.0 - sound_sigma, 1.0, 1.0)
    device = latents.device
    video_rows, sound_rows = denoiser(
        hidden_states=patchify_video_latents(latents, pipe.patch_size)[None],
        audio_hidden_states=sound.permute(0, 2, 1).reshape(1, -1, sound_channels),
        encoder_hidden_states=text[None],
        timestep=unique.to(device), timestep_indices=row_indices.to(device), token_tags=token_tags.to(device),
        position_ids=position_ids.to(device, torch.float32), video_indices=video_indices.to(device),
        audio_indices=audio_indices.to(device), text_indices=text_indices.to(device), return_dict=False,
    )
    return -_unpatchify(video_rows[0], latents.shape, pipe.patch_size), -sound_rows[0].reshape(
        tracks, length, sound_channels).permute(0, 2, 1)


def _unpatchify(rows: torch.Tensor, shape: torch.Size, patch: tuple[int, int, int]) -> torch.Tensor:
    """``patchify_video_latents`` undone: rows frame-major then row-major back to [1, C, f, h, w]."""
    _, channels, frames, height, width = shape
    patch_t, patch_h, patch_w = patch
    grid = rows.reshape(frames // patch_t, height // patch_h, width // patch_w, channels, patch_t, patch_h, patch_w)
    return grid.permute(3, 0, 4, 1, 5, 2, 6).reshape(1, channels, frames, height, width)
