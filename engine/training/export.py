"""A trained adapter written out: diffusers' format, and the layout kohya's sd-scripts and ComfyUI load.

The run always writes diffusers' format (``pytorch_lora_weights.safetensors``,
:func:`save_lora`, with the adapter's alpha in its metadata);
with ``export_kohya`` it also writes ``lora_kohya.safetensors``: keys
``lora_unet_<module>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
with ``ss_*`` metadata, the layout both tools read.

The key layout itself (both ways) is :mod:`engine.runtime.kohya`. Module names
follow the family's ``lora_kohya_map`` where the original
checkpoint's layout differs from diffusers' (a rule may fuse several
diffusers Linears into one original Linear, e.g. q, k and v into ``qkv``);
other modules keep their diffusers path with dots turned into underscores,
which is how kohya names diffusers-layout modules and what diffusers'
``lora_state_dict`` converters read back.

A fused module stacks the parts' LoRAs block-diagonally: ``down`` is the
parts' ``A`` matrices stacked (rank = the sum of the parts' ranks), ``up``
has each part's ``B`` in its own rows and columns, zeros elsewhere; a part
the run did not adapt contributes zero rows (its weight is unchanged). With
``alpha`` scaled by the number of parts, ``alpha / rank`` stays the
adapter's scale, so the fused delta equals the parts' deltas exactly, and
diffusers' kohya converter recognises the block structure and splits it
back into the original matrices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime import family_hooks
from engine.runtime.kohya import OutFeatures, kohya_state_dict
from engine.contract.types import FamilySpec

if TYPE_CHECKING:
    from engine.contract.plugins import Registry
    from engine.training.preflight import TrainingPlan

#: The diffusers-format LoRA a run writes (the name ``load_lora_weights`` looks for).
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "lora_kohya.safetensors"

def kohya_metadata(
    *, family: FamilySpec, base_model: str, rank: int, alpha: float, resolution: int, steps: int,
    targets: tuple[str, ...],
) -> dict[str, str]:
    """The ``ss_*`` fields kohya's sd-scripts write and UIs show (all strings)."""
    return {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": family.name,
        "ss_sd_model_name": Path(base_model).name or base_model,
        "ss_resolution": f"({resolution}, {resolution})",
        "ss_max_train_steps": str(steps),
        "ss_steps": str(steps),
        "ss_network_args": json.dumps({"target_modules": list(targets)}),
        "ss_training_comment": f"trained with diffusion-engine on {base_model}",
    }


def denoiser_out_features(denoiser: torch.nn.Module) -> OutFeatures:
    """Out features of a denoiser module by name (peft-wrapped or not)."""

    def out_features(name: str) -> int:
        module = denoiser.get_submodule(name)
        module = getattr(module, "base_layer", module)
        return int(getattr(module, "out_features"))

    return out_features


def write_kohya(
    family: FamilySpec,
    state: Mapping[str, torch.Tensor],
    alpha: float,
    out_features: OutFeatures,
    metadata: Mapping[str, str],
    output_dir: Path,
) -> Path:
    """Write :data:`KOHYA_FILE` into ``output_dir``; return its path."""
    from safetensors.torch import save_file

    path = output_dir / KOHYA_FILE
    save_file(kohya_state_dict(family, state, alpha, out_features), str(path), metadata=dict(metadata))
    return path


def export_kohya(
    plan: TrainingPlan, denoiser: torch.nn.Module, state: Mapping[str, torch.Tensor], output_dir: Path
) -> Path:
    """The run's adapter as :data:`KOHYA_FILE`, with the run's ``ss_*`` metadata."""
    config = plan.config
    alpha = float(config.lora_alpha or config.lora_rank)
    metadata = kohya_metadata(
        family=plan.family, base_model=str(plan.base.location), rank=config.lora_rank, alpha=alpha,
        resolution=config.resolution, steps=plan.steps, targets=tuple(plan.lora_targets),
    )
    return write_kohya(plan.family, state, alpha, denoiser_out_features(denoiser), metadata, output_dir)


def save_lora(
    plan: TrainingPlan, pipe: Any, denoiser: torch.nn.Module, output_dir: Path, *, registry: Registry,
    component: str | None = None,
) -> dict[str, str]:
    """The adapter in diffusers' key format (``transformer.<module>.lora_A.weight``,
    what diffusers' own training scripts write; loads with ``load_lora_weights``).

    Both experts of a two-expert run (:class:`~engine.training.experts.ExpertPair`) are
    written one file each: the high-noise expert's here, the low-noise one's in
    ``low_noise/`` (its outputs keyed ``..._low_noise``); each loads on its own, the second
    with ``load_lora_weights(..., load_into_transformer_2=True)``."""
    from safetensors.torch import save_file

    experts = getattr(denoiser, "experts", None)
    if callable(experts):
        from engine.training.experts import EXPERT_FOLDERS

        both: dict[str, str] = {}
        for (name, module), component in zip(experts().items(), plan.trained_components, strict=True):
            saved = save_lora(plan, pipe, module, output_dir / EXPERT_FOLDERS[name], registry=registry,
                              component=component)
            both.update({key if name == "high" else f"{key}_low_noise": path for key, path in saved.items()})
        return both

    output_dir.mkdir(parents=True, exist_ok=True)
    state = family_hooks.lora_state_dict(registry, plan.family, denoiser)  # engine_lora_state_dict
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    prefix = plan.family.pipeline.denoiser
    saver = getattr(type(pipe), "save_lora_weights", None)
    lora_path = output_dir / LORA_WEIGHTS
    if saver is not None:
        saver(str(output_dir), **{f"{prefix}_lora_layers": state}, **_adapter_metadata(saver, prefix, denoiser),
              weight_name=LORA_WEIGHTS)
    else:
        save_file({f"{prefix}.{k}": v for k, v in state.items()}, str(lora_path))
    component = component or plan.trained_components[0]
    if component != plan.family.pipeline.denoiser:  # a second expert's LoRA says where it goes
        _mark_component(lora_path, component)
    outputs: dict[str, str] = {"lora": str(lora_path)}
    if plan.config.export_kohya:
        outputs["lora_kohya"] = str(export_kohya(plan, denoiser, state, output_dir))
    return outputs


def _mark_component(path: Path, component: str) -> None:
    """Add :data:`~engine.requests.references.LORA_COMPONENT_KEY` to the file's metadata: the
    engine's LoRA door then loads it into ``component`` (diffusers' ``load_into_<component>``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from engine.requests.references import LORA_COMPONENT_KEY

    with safe_open(str(path), framework="pt") as opened:
        metadata = dict(opened.metadata() or {})
    save_file(load_file(str(path)), str(path), metadata={**metadata, LORA_COMPONENT_KEY: component})


def _adapter_metadata(saver: Callable[..., Any], prefix: str, denoiser: torch.nn.Module) -> dict[str, Any]:
    """The adapter's peft config for ``save_lora_weights`` (what diffusers' own training
    scripts pass): without it a loader assumes ``alpha == rank`` and a LoRA trained with
    another alpha would be applied at the wrong strength."""
    import inspect

    config = getattr(denoiser, "peft_config", {}).get("default")
    field = f"{prefix}_lora_adapter_metadata"
    if config is None or field not in inspect.signature(saver).parameters:
        return {}
    # Sets (target_modules) as sorted lists: the file is then the same bytes in every process.
    metadata = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.to_dict().items()}
    return {field: metadata}
