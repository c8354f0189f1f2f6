"""The engine's default LoRA adapter code behind the ``engine_lora_*`` hooks.

diffusers' peft integration (``add_adapter``, ``load_lora_adapter``) is used
where the denoiser class has it; any other ``torch.nn.Module`` gets peft's
generic ``inject_adapter_in_model``, which needs nothing from the class. A
family whose denoiser needs more (fused projections, custom layers) answers
the hooks itself, so the engine never needs a monkeypatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.errors import EngineError
from engine.runtime.quantize import first_line

_A, _B = ".lora_A.weight", ".lora_B.weight"


class AdapterFailed(EngineError):
    """A LoRA could not be added to or loaded into the denoiser."""

    code = "lora_adapter_failed"


def add_adapter(denoiser: torch.nn.Module, config: Any, adapter_name: str) -> str:
    """Add a trainable adapter; returns how (for the run's events)."""
    if callable(getattr(denoiser, "add_adapter", None)):
        denoiser.add_adapter(config, adapter_name=adapter_name)
        return "diffusers' peft integration (add_adapter)"
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, denoiser, adapter_name=adapter_name)
    except ValueError as exc:  # peft: no target module found
        raise AdapterFailed(
            f"peft could not add a LoRA to {type(denoiser).__name__}: {first_line(exc)[:300]}; "
            "check the family's lora.targets (or the run's lora_targets)"
        ) from exc
    return f"peft's inject_adapter_in_model ({type(denoiser).__name__} has no add_adapter)"


def adapter_state_dict(denoiser: torch.nn.Module, adapter_name: str) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's keys, without the adapter name."""
    from peft.utils import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(denoiser, adapter_name=adapter_name))


def load_adapter(denoiser: torch.nn.Module, state: Mapping[str, torch.Tensor], adapter_name: str) -> str:
    """Load a saved adapter (peft keys, no component prefix) as ``adapter_name``."""
    if callable(getattr(denoiser, "load_lora_adapter", None)):
        denoiser.load_lora_adapter(dict(state), prefix=None, adapter_name=adapter_name)
        return "diffusers' peft integration (load_lora_adapter)"
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    inject_adapter_in_model(config_for(state), denoiser, adapter_name=adapter_name)
    result = set_peft_model_state_dict(denoiser, dict(state), adapter_name=adapter_name)
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) if "lora" in k]
    if unexpected:
        raise AdapterFailed(
            f"{len(unexpected)} LoRA keys landed on no module of {type(denoiser).__name__} "
            f"(first: {unexpected[0]}); give a LoRA trained for this model"
        )
    return f"peft's inject_adapter_in_model ({type(denoiser).__name__} has no load_lora_adapter)"


def config_for(state: Mapping[str, torch.Tensor]) -> Any:
    """A peft ``LoraConfig`` that recreates the layers ``state`` was saved from:
    its modules, and each one's rank (alpha = rank: the saved scale)."""
    from peft import LoraConfig

    ranks = {key[: -len(_A)]: int(value.shape[0]) for key, value in state.items() if key.endswith(_A)}
    if not ranks:
        raise AdapterFailed("the LoRA has no lora_A weights in peft's keys; it cannot be loaded")
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    pattern = {module: r for module, r in ranks.items() if r != rank}
    return LoraConfig(
        r=rank, lora_alpha=rank, target_modules=sorted(ranks),
        rank_pattern=pattern, alpha_pattern=dict(pattern),
    )


def set_scales(denoiser: torch.nn.Module, names: list[str], scales: list[float]) -> None:
    """Activate ``names`` with ``scales`` on every peft layer of ``denoiser``."""
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters

    set_weights_and_activate_adapters(denoiser, names, scales)


def delete(denoiser: torch.nn.Module, names: list[str]) -> None:
    """Remove adapters from every peft layer of ``denoiser``."""
    from diffusers.utils.peft_utils import delete_adapter_layers

    for name in names:
        delete_adapter_layers(denoiser, name)
