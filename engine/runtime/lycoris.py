"""LyCORIS adapters (LoKr, LoHa) read into peft's own adapter types.

Trainers write them as tensors named as peft names them (``<module>.lokr_w1``,
``.lokr_w2_a``, ``.hada_w1_a``...) with one ``alpha`` per module, under a prefix (diffusers'
``transformer.``, ComfyUI's ``diffusion_model.``, peft's ``base_model.model.``) or as kohya
module names (``lora_unet_transformer_blocks_0_attn_to_q``). diffusers' loader reads only
low-rank pairs, so these are injected with peft (``LoKrConfig`` / ``LoHaConfig``: their ranks,
alphas and factorisation read off the tensors) under the adapter name the LoRA set gives them,
and then switched, scaled, fused and deleted as diffusers does any peft adapter. Every tensor
lands on a module of the denoiser or the file is refused naming the one that does not.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from engine.preflight.lora import LYCORIS_PARAMS, LoraFile, LoraMismatch

#: Prefixes trainers put before the denoiser's module names.
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")
_KOHYA = "lora_unet_"


def grouped(file: LoraFile, denoiser: torch.nn.Module) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """The file's tensors by the denoiser module each adapts (``{module: {param: tensor}}``), and
    the modules named that the denoiser does not have (or has as another kind of layer)."""
    from safetensors.torch import load_file

    named = {name: module for name, module in denoiser.named_modules() if name}
    kohya = {name.replace(".", "_"): name for name in named}
    params = set(LYCORIS_PARAMS[file.adapter_type]) | {"alpha"}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    foreign: list[str] = []
    for key, tensor in load_file(str(file.path)).items():
        stem, _, param = key.rpartition(".")
        if param not in params:
            foreign.append(key)
            continue
        module = _module_name(stem, kohya)
        base = getattr(named.get(module), "base_layer", named.get(module))
        if not isinstance(base, (torch.nn.Linear, torch.nn.Conv2d)):
            foreign.append(stem)
            continue
        modules.setdefault(module, {})[param] = tensor
    return modules, sorted(set(foreign))


def _module_name(stem: str, kohya: dict[str, str]) -> str:
    if stem.startswith(_KOHYA):
        return kohya.get(stem[len(_KOHYA):], stem)
    for prefix in _PREFIXES:
        if stem.startswith(prefix):
            return stem[len(prefix):]
    return stem


def load(model: torch.nn.Module, file: LoraFile, adapter_name: str) -> None:
    """Inject ``file`` into ``model`` as peft's LoKr or LoHa adapter ``adapter_name``."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    modules, foreign = grouped(file, model)
    if (foreign and not file.partial) or not modules:  # a partial load skips them: the plan counted them
        raise LoraMismatch(f"LoRA {file.path} ({file.adapter_type}) adapts {len(foreign)} module(s) this model does "
                           f"not have (e.g. {', '.join(foreign[:3]) or 'none at all'}); nothing was applied. "
                           "Give a LoRA trained for this model")
    config = _config(file.adapter_type, modules)
    state = {f"{module}.{param}": tensor for module, params in modules.items()
             for param, tensor in params.items() if param != "alpha"}
    inject_adapter_in_model(config, model, adapter_name=adapter_name, state_dict=state)
    result = set_peft_model_state_dict(model, state, adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise LoraMismatch(f"LoRA {file.path}: peft could not place {unexpected[0]} (and {len(unexpected) - 1} more) "
                           f"in a {file.adapter_type} adapter of this model; nothing was applied")
    model._hf_peft_config_loaded = True  # type: ignore[assignment]  # as diffusers marks a model it loaded into


def _config(kind: str, modules: dict[str, dict[str, torch.Tensor]]) -> Any:
    """peft's config reproducing the file's layout: each module's rank (the factors' inner
    side), alpha, and for LoKr whether the first factor is decomposed too."""
    from peft import LoHaConfig, LoKrConfig

    ranks, alphas = {}, {}
    for module, params in modules.items():
        factor = next((params[p] for p in ("lokr_w2_a", "lokr_w1_a", "hada_w1_a") if p in params), None)
        if factor is not None:
            ranks[module] = int(factor.shape[1])
        else:  # LoKr with both factors whole: any rank at least half the larger factor keeps them whole
            ranks[module] = max(int(s) for p in ("lokr_w1", "lokr_w2") for s in params[p].shape)
        alphas[module] = float(params["alpha"]) if "alpha" in params else float(ranks[module])
    rank, alpha = max(ranks.values()), max(alphas.values())
    shared = {"target_modules": sorted(modules), "r": rank, "alpha": alpha,
              "rank_pattern": {re.escape(m): r for m, r in ranks.items() if r != rank},
              "alpha_pattern": {re.escape(m): a for m, a in alphas.items() if a != alpha}}
    if kind == "lokr":
        both = any("lokr_w1_a" in params for params in modules.values())
        return LoKrConfig(decompose_both=both, **shared)
    return LoHaConfig(**shared)

