"""The tool's models: a family's denoiser built from its table's ``MemoryProbe``.

:class:`Denoiser` holds what :mod:`engine.testing.memory_measure` needs to build a
family's denoiser at real widths and a reduced depth and to feed it (its config,
conditioning, pipeline helpers); the block helpers count and name its repeated blocks
and list its LoRA targets at full depth, for :mod:`engine.testing.memory_figures`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from engine.policy.training_memory import lora_target_shapes
from engine.contract.types import FamilySpec, LoraTargetShape, MemoryProbe


# ---------------------------------------------------------------------------
# families: the real architecture, and how to feed it (the family's probe)
# ---------------------------------------------------------------------------


class NoProbe(Exception):
    """A family whose table has no ``MemoryProbe``: the tool cannot build its denoiser."""


@dataclass(frozen=True)
class Denoiser:
    """One family's denoiser as the tool builds and feeds it, from its table's probe."""

    spec: FamilySpec
    probe: MemoryProbe

    @classmethod
    def of(cls, spec: FamilySpec) -> Denoiser:
        if spec.training.probe is None:
            raise NoProbe(
                f"{spec.name}: its table has no memory probe; add training=TrainingSpec(probe=MemoryProbe("
                "model_class=..., blocks=..., text_tokens=..., text_dim=..., derive=..., deeper=...)) "
                "(docs/plugins.md, 'Training memory figures')"
            )
        return cls(spec, spec.training.probe)

    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def model_class(self) -> str:
        return self.probe.model_class

    @property
    def full(self) -> dict[str, Any]:
        return dict(self.probe.full)

    @property
    def derive(self) -> dict[str, Any]:
        return dict(self.probe.derive)

    @property
    def deeper(self) -> dict[str, Any] | None:
        return None if self.probe.deeper is None else dict(self.probe.deeper)

    @property
    def check(self) -> dict[str, Any]:
        return dict(self.probe.check)

    @property
    def narrow(self) -> dict[str, Any]:
        return dict(self.probe.narrow)

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.probe.blocks

    @property
    def latent_channels(self) -> int:
        return self.probe.latent_channels

    @property
    def half_blocks(self) -> tuple[str, ...]:
        return self.probe.half_blocks

    @property
    def text_tokens(self) -> int:
        return self.probe.text_tokens

    @property
    def text_dim(self) -> str:
        return self.probe.text_dim

    @property
    def pooled_dim(self) -> int:
        return self.probe.pooled_dim

    @property
    def runtime(self) -> Any:
        from engine.contract.family_runtime import load_runtime

        return load_runtime(self.spec)


def _config(d: Denoiser, overrides: dict[str, Any]) -> dict[str, Any]:
    import diffusers

    signature = inspect.signature(getattr(diffusers, d.model_class).__init__)
    defaults = {k: v.default for k, v in signature.parameters.items()
                if v.default is not inspect.Parameter.empty}
    return {**defaults, **d.full, **overrides}


def full_config(d: Denoiser) -> dict[str, Any]:
    """The denoiser's full-size config: the class defaults with the probe's ``full`` overrides."""
    return _config(d, {})


def _pipe_shim(d: Denoiser, model: torch.nn.Module) -> Any:
    """What the runtime's ``predict`` reads from a pipeline: the family's ``probe_pipeline``
    where it has one, else the denoiser and the VAE scale (the family's geometry)."""
    own = getattr(d.runtime, "probe_pipeline", None)
    if own is not None:
        return own(model)
    return SimpleNamespace(vae_scale_factor=d.spec.rendering.geometry.spatial_compression, transformer=model, unet=model)


def _conditioning(
    d: Denoiser, config: dict[str, Any], text: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What the runtime's ``encode_prompts`` returns, for a prompt of ``text`` positions:
    the family's ``probe_conditioning`` where it has one, else ``prompt_embeds`` (and the
    pooled embedding where the probe names its width)."""
    own = getattr(d.runtime, "probe_conditioning", None)
    if own is not None:
        return own(config, text, dtype)  # type: ignore[no-any-return]
    conditioning = {"prompt_embeds": torch.randn(1, text, config[d.text_dim], dtype=dtype)}
    if d.pooled_dim:
        conditioning["pooled_prompt_embeds"] = torch.randn(1, d.pooled_dim, dtype=dtype)
    return conditioning


# ---------------------------------------------------------------------------
# the denoiser's repeated blocks and its LoRA targets at full depth
# ---------------------------------------------------------------------------


def count_blocks(d: Denoiser, config: dict[str, Any]) -> int:
    """Repeated blocks of ``config``, as ``ActivationFigures.blocks`` counts them."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, d.model_class).from_config(config)
    units = sum(0.5 if any(n.startswith(h) for h in d.half_blocks) else 1.0 for n, _ in _named_blocks(d, model))
    return int(units)


def _named_blocks(d: Denoiser, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in d.blocks]


def _blocks(d: Denoiser, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (their forward hooks measure what each keeps)."""
    return [m for _, m in _named_blocks(d, model)]


def full_size_model(d: Denoiser) -> torch.nn.Module:
    """The denoiser at its full-size config on the meta device (shapes only, no weights)."""
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, d.model_class).from_config(full_config(d))  # type: ignore[no-any-return]


def full_lora_targets(d: Denoiser) -> tuple[LoraTargetShape, ...]:
    """LoRA target shapes and counts of the full-size model, read on the meta device."""
    shapes = [(n, tuple(p.shape)) for n, p in full_size_model(d).named_parameters()]
    return lora_target_shapes(shapes, d.spec.lora.targets)
