"""Fixture families for the capability and contract-kit tests.

``bare``: a Stable Diffusion 3 pipeline (the example plugin's tiny parts)
whose denoiser is a small torch module with none of diffusers' extras: no
cache hooks, no attention processors for the dispatcher, no peft
integration. Its plugin answers the runtime hooks (adding, saving and loading
the LoRA with peft's generic injection; the generate call's arguments) and
records every call. ``broken``: the same pipeline, whose denoiser fails
at the first step, for the kit to catch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from engine.contract.hookspecs import hookimpl
from engine.contract.types import Checkpoint, FamilySpec, LoraLayout
from tests.support import EXAMPLE_PLUGIN

if str(EXAMPLE_PLUGIN) not in sys.path:  # the example's tiny SD3 parts, imported as a user would
    sys.path.append(str(EXAMPLE_PLUGIN))

from diffusion_engine_sd3 import SD3  # noqa: E402
from diffusion_engine_sd3.tiny import build_pipeline  # noqa: E402


class BareBlock(torch.nn.Module):
    """Self-attention through ``scaled_dot_product_attention`` called directly."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = 4
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(width, width) for _ in range(3))
        self.to_out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (
            p(x).view(b, n, self.heads, c // self.heads).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v)
        )
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.to_out(attended.transpose(1, 2).reshape(b, n, c))


class BareDenoiser(ModelMixin, ConfigMixin):
    """A small denoiser with SD3's call signature and nothing else diffusers offers."""

    @register_to_config
    def __init__(
        self, in_channels: int = 16, sample_size: int = 8, patch_size: int = 2,
        joint_attention_dim: int = 64, pooled_projection_dim: int = 64, width: int = 32,
    ) -> None:
        super().__init__()
        self.proj_in = torch.nn.Conv2d(in_channels, width, 1)
        self.context = torch.nn.Linear(joint_attention_dim, width)
        self.pooled = torch.nn.Linear(pooled_projection_dim, width)
        self.time = torch.nn.Linear(1, width)
        self.block = BareBlock(width)
        self.proj_out = torch.nn.Conv2d(width, in_channels, 1)

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor, joint_attention_kwargs: Any = None, return_dict: bool = True,
    ) -> tuple[torch.Tensor]:
        b, _, h, w = hidden_states.shape
        cond = (
            self.context(encoder_hidden_states).mean(1) + self.pooled(pooled_projections)
            + self.time(timestep.to(hidden_states.dtype).reshape(b, 1) / 1000)
        )
        x = self.proj_in(hidden_states) + cond[:, :, None, None]
        tokens = self.block(x.flatten(2).transpose(1, 2))
        return (self.proj_out(tokens.transpose(1, 2).reshape(b, -1, h, w)),)


class BrokenDenoiser(BareDenoiser):
    """Loads fine, fails at the first denoising step (a shape bug: the
    latents go through the text projection)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        return (self.context(hidden_states),)


def _builder(cls: type[BareDenoiser]) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        path = Path(path)
        torch.manual_seed(0)
        build_pipeline(denoiser=cls().eval()).save_pretrained(path, safe_serialization=True)
        return path

    return build


def _spec(name: str) -> FamilySpec:
    return dataclasses.replace(
        SD3, name=name, label=f"{name} test family", aliases=(),
        checkpoints=(Checkpoint(name=name, label=name, repo=f"someone/{name}", default_steps=2,
                                default_guidance=1.0, matches=(f"*{name}*",)),),
        lora=LoraLayout(targets=("to_q", "to_k", "to_v", "to_out")),
        speed=dataclasses.replace(SD3.speed, compile_regions=()), tiny_pipeline="",
        capabilities=type(SD3.capabilities)(),
        quantisation=dataclasses.replace(SD3.quantisation, deny_inference=(), deny_training=(),
                                         prequantised_patterns=()),
    )


BARE, BROKEN = _spec("bare"), _spec("broken")


class FixturePlugin:
    """Registers one fixture family and answers the runtime hooks for it, recording each call."""

    def __init__(self, spec: FamilySpec, denoiser: type[BareDenoiser]) -> None:
        self.spec = spec
        self.build = _builder(denoiser)
        self.calls: list[str] = []

    def _mine(self, family: FamilySpec) -> bool:
        return family.name == self.spec.name

    @hookimpl
    def engine_register_families(self, register: Callable[[FamilySpec], None]) -> None:
        register(self.spec)

    @hookimpl
    def engine_build_tiny_pipeline(self, family: FamilySpec, path: Path) -> Path | None:
        return self.build(path) if self._mine(family) else None

    @hookimpl
    def engine_lora_add(self, family: FamilySpec, denoiser: Any, config: Any, adapter_name: str) -> str | None:
        if not self._mine(family):
            return None
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, denoiser, adapter_name=adapter_name)
        self.calls.append("lora_add")
        return "the bare family's hook (peft inject_adapter_in_model)"

    @hookimpl
    def engine_lora_state_dict(self, family: FamilySpec, denoiser: Any, adapter_name: str) -> dict | None:
        if not self._mine(family):
            return None
        from peft.utils import get_peft_model_state_dict

        self.calls.append("lora_state_dict")
        return get_peft_model_state_dict(denoiser, adapter_name=adapter_name)

    @hookimpl
    def engine_lora_load(self, family: FamilySpec, pipeline: Any, state_dict: dict, adapter_name: str) -> str | None:
        if not self._mine(family):
            return None
        from engine.runtime.adapters import load_adapter

        self.calls.append("lora_load")
        return load_adapter(pipeline.transformer, state_dict, adapter_name)

    @hookimpl
    def engine_generate_kwargs(self, family: FamilySpec, pipeline: Any, kwargs: dict) -> dict | None:
        if not self._mine(family):
            return None
        self.calls.append("generate_kwargs")
        return {**kwargs, "max_sequence_length": 32}  # a call argument only this family sets
