"""LTX-2's torch code for the generic LoRA trainer loop: clips (and stills) trained with their sound.

The loop owns noise, the sigma draw and the flow-matching target; this module owns what only
LTX-2 knows, through ``LTX2Pipeline``'s own pieces so a LoRA sees at training time what the
pipeline feeds its transformer at inference:

* prompts: Gemma-3 through the pipeline's ``encode_prompt`` (padded to its 1024 positions),
  then its text ``connectors``, which give the video stream's and the audio stream's text
  and their mask (the connectors are not trained: computed once);
* clips: ``[B, 3, F, H, W]`` pixels in [-1, 1] through the video VAE, its posterior's mode
  normalised as the pipeline normalises latents (``_normalize_latents``), 8k+1 frames into
  k+1 latent frames;
* sound: ``[2, n]`` samples at the audio VAE's 16 kHz as its encoder reads them, a log-mel
  spectrogram (magnitude STFT, Hann window of ``N_FFT``, the VAE's hop and mel bins, Slaney
  mel scale and norm, log clamped at 1e-5, as the LTX-2 trainer computes it), through the
  audio VAE to ``[C, t, m]`` latents normalised in the pipeline's packed layout;
* the model call: both streams packed as the pipeline packs them, their positions from the
  transformer's own rope (``prepare_video_coords`` / ``prepare_audio_coords``), the picture at
  timestep ``sigma * 1000`` and the sound at its own; the velocities (``noise - x0``, what the
  flow-matching scheduler steps with) unpacked back.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2Pipeline

#: The STFT window of LTX-2's audio front end (its trainer's ``AudioProcessor``: 1024 at 16 kHz).
N_FFT: int = 1024
#: The flow-matching scheduler's timestep scale (sigma 1.0 is timestep 1000).
TIMESTEP_SCALE: float = 1000.0
#: The frame rate the picture's positions are laid out at (the checkpoint's).
FPS: float = 24.0


def encode_prompts(pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The connectors' video and audio text [B, L, D] and their mask [B, L] (no grad)."""
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                device=device, dtype=dtype)
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=side)
    return {"prompt_embeds": video.to(device, dtype), "audio_prompt_embeds": audio.to(device, dtype),
            "attention_mask": connector_mask.to(device)}


def encode_images(pipe: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, C, f, h, w] for pixels [B, 3, F, H, W] (or one frame [B, 3, H, W]) in [-1, 1]."""
    vae = pipe.vae
    clip = pixels.unsqueeze(2) if pixels.dim() == 4 else pixels
    with torch.no_grad():
        latents = vae.encode(clip.to(vae.dtype)).latent_dist.mode()
    return LTX2Pipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def log_mel(samples: torch.Tensor, rate: int, hop: int, bins: int) -> torch.Tensor:
    """``samples`` [C, n] as LTX-2's audio encoder reads them: [C, frames, bins] log-magnitudes."""
    from transformers.audio_utils import mel_filter_bank

    window = torch.hann_window(N_FFT, device=samples.device, dtype=torch.float32)
    spectrum = torch.stft(samples.float(), N_FFT, hop_length=hop, win_length=N_FFT, window=window, center=True,
                          pad_mode="reflect", return_complex=True).abs()
    filters = torch.from_numpy(mel_filter_bank(N_FFT // 2 + 1, bins, 0.0, rate / 2, rate, norm="slaney",
                                               mel_scale="slaney")).to(spectrum)
    mel = torch.einsum("fm,cft->ctm", filters, spectrum)
    return torch.log(torch.clamp(mel, min=1e-5))


def encode_sound(pipe: Any, samples: torch.Tensor) -> torch.Tensor:
    """Normalised audio latents [C, t, m] for one track [2, n] in [-1, 1] at the audio VAE's rate."""
    vae = pipe.audio_vae
    mel = log_mel(samples, vae.config.sample_rate, vae.config.mel_hop_length, vae.config.mel_bins)
    with torch.no_grad():
        latents = vae.encode(mel[None].to(vae.dtype)).latent_dist.mode()
    _, channels, length, bins = latents.shape
    packed = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(latents), vae.latents_mean,
                                                   vae.latents_std)
    return LTX2Pipeline._unpack_audio_latents(packed, length, num_mel_bins=bins)[0]


def predict(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
            conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    """The picture's velocity alone: its sound pure noise at sigma 1 (nothing heard), as long as the clip."""
    frames = (noisy_latents.shape[2] - 1) * pipe.vae_temporal_compression_ratio + 1
    vae = pipe.audio_vae
    per_second = vae.config.sample_rate / vae.config.mel_hop_length / vae.temporal_compression_ratio
    length = max(1, round(frames / FPS * per_second))
    bins = vae.config.mel_bins // vae.mel_compression_ratio
    silence = torch.randn(noisy_latents.shape[0], vae.config.latent_channels, length, bins,
                          device=noisy_latents.device, dtype=noisy_latents.dtype)
    video, _ = predict_with_sound(pipe, denoiser, noisy_latents, silence, timesteps, torch.ones_like(timesteps),
                                  conditioning)
    return video


def predict_with_sound(pipe: Any, denoiser: Any, noisy_latents: torch.Tensor, noisy_sound: torch.Tensor,
                       timesteps: torch.Tensor, sound_timesteps: torch.Tensor,
                       conditioning: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both velocities (``noise - x0``) for ``noisy_latents`` [B, C, f, h, w] at sigmas ``timesteps``
    and ``noisy_sound`` [B, c, t, m] at ``sound_timesteps``, in one transformer call."""
    batch, _, frames, height, width = noisy_latents.shape
    _, _, length, bins = noisy_sound.shape
    patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    device, dtype = noisy_latents.device, conditioning["prompt_embeds"].dtype
    timestep = timesteps.to(device, torch.float32) * TIMESTEP_SCALE
    sound_timestep = sound_timesteps.to(device, torch.float32) * TIMESTEP_SCALE
    rope, audio_rope = pipe.transformer.rope, pipe.transformer.audio_rope  # weightless: the positions alone
    video, sound = denoiser(
        hidden_states=LTX2Pipeline._pack_latents(noisy_latents, patch, patch_t).to(dtype),
        audio_hidden_states=LTX2Pipeline._pack_audio_latents(noisy_sound).to(dtype),
        encoder_hidden_states=conditioning["prompt_embeds"], audio_encoder_hidden_states=conditioning["audio_prompt_embeds"],
        timestep=timestep, audio_timestep=sound_timestep, sigma=timestep, audio_sigma=sound_timestep,
        encoder_attention_mask=conditioning["attention_mask"], audio_encoder_attention_mask=conditioning["attention_mask"],
        num_frames=frames, height=height, width=width, fps=FPS, audio_num_frames=length,
        video_coords=rope.prepare_video_coords(batch, frames, height, width, device, fps=FPS),
        audio_coords=audio_rope.prepare_audio_coords(batch, length, device),
        return_dict=False,
    )
    return (LTX2Pipeline._unpack_latents(video.float(), frames, height, width, patch, patch_t),
            LTX2Pipeline._unpack_audio_latents(sound.float(), length, num_mel_bins=bins))
