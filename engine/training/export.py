"""A trained adapter written out: diffusers' format, and the layout kohya's sd-scripts and ComfyUI load.

The run always writes diffusers' format (``pytorch_lora_weights.safetensors``,
:func:`save_lora`, with the adapter's alpha in its metadata);
with ``export_kohya`` it also writes ``lora_kohya.safetensors``: keys
``lora_unet_<module>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
with ``ss_*`` metadata, the layout both tools read.

Module names follow the family's ``lora_kohya_map`` where the original
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
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.types import FamilySpec

if TYPE_CHECKING:
    from engine.plugins import Registry
    from engine.training.preflight import TrainingPlan

#: The diffusers-format LoRA a run writes (the name ``load_lora_weights`` looks for).
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "lora_kohya.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"

#: The out features of a module of the denoiser (for parts the run did not adapt).
OutFeatures = Callable[[str], int]


@dataclass(frozen=True)
class _Rule:
    target: str
    sources: tuple[str, ...]

    def match(self, module: str) -> tuple[int, str] | None:
        """(which source, block index) when ``module`` is one of this rule's sources."""
        for position, source in enumerate(self.sources):
            pattern = "^" + re.escape(source).replace(r"\{i\}", r"(\d+)") + "$"
            found = re.match(pattern, module)
            if found:
                return position, (found.group(1) if found.groups() else "")
        return None


def kohya_state_dict(
    family: FamilySpec,
    state: Mapping[str, torch.Tensor],
    alpha: float,
    out_features: OutFeatures,
) -> dict[str, torch.Tensor]:
    """``state`` (peft keys ``<module>.lora_A.weight``, no adapter name) in the
    kohya / ComfyUI layout for ``family``; ``alpha`` is the adapter's alpha."""
    rules = [_Rule(target, sources) for target, sources in family.lora.kohya_map]
    modules = sorted({k[: -len(_A)] for k in state if k.endswith(_A)})
    groups: dict[tuple[int, str], dict[int, str]] = {}
    kohya: dict[str, torch.Tensor] = {}
    for module in modules:
        hit = next(((n, m) for n, rule in enumerate(rules) if (m := rule.match(module))), None)
        if hit is None:
            _put(kohya, "lora_unet_" + module.replace(".", "_"), state[module + _A], state[module + _B], alpha)
            continue
        rule_index, (position, block) = hit
        groups.setdefault((rule_index, block), {})[position] = module
    for (rule_index, block), parts in groups.items():
        rule = rules[rule_index]
        name = "lora_unet_" + rule.target.replace("{i}", block)
        if len(rule.sources) == 1:
            module = parts[0]
            _put(kohya, name, state[module + _A], state[module + _B], alpha)
            continue
        downs, ups = [], []
        rank = max(state[m + _A].shape[0] for m in parts.values())
        reference = state[next(iter(parts.values())) + _A]
        for position, source in enumerate(rule.sources):
            module = parts.get(position)
            if module is not None:
                downs.append(state[module + _A])
                ups.append(state[module + _B])
            else:  # a part the run did not adapt: zero rows, its weight unchanged
                rows = out_features(source.replace("{i}", block))
                downs.append(reference.new_zeros(rank, reference.shape[1]))
                ups.append(reference.new_zeros(rows, rank))
        _put(kohya, name, torch.cat(downs), torch.block_diag(*ups), alpha * len(rule.sources))
    return kohya


def diffusers_from_kohya(
    family: FamilySpec, kohya: Mapping[str, torch.Tensor], linears: Mapping[str, int]
) -> dict[str, torch.Tensor] | None:
    """A kohya / ComfyUI LoRA of ``family`` in peft keys (``<module>.lora_A.weight``), or None
    when it names no module of the family's ``kohya_map`` (diffusers' own converters read it).

    The inverse of :func:`kohya_state_dict`, with the widths taken from the model
    (``linears``: every Linear of the denoiser and its out features), never assumed: a
    fused module's ``up`` is split by the parts' widths, each part keeping the whole
    ``down``, so each part's delta is exactly its rows of the fused delta (true for any
    fused LoRA, block-diagonal or not). ``alpha / rank`` is folded into ``down``. A
    module the model does not have (or whose widths differ) keeps its kohya name, so the
    caller's match check names it.
    """
    rules = [_Rule(target, sources) for target, sources in family.lora.kohya_map]
    prefix, down_key = "lora_unet_", ".lora_down.weight"
    modules = sorted(k[len(prefix):-len(down_key)] for k in kohya if k.startswith(prefix) and k.endswith(down_key))
    targets = [(re.compile("^" + re.escape(rule.target).replace(r"\{i\}", r"(\d+)") + "$"), rule) for rule in rules]
    underscored = {name.replace(".", "_"): name for name in linears}
    converted: dict[str, torch.Tensor] = {}
    fused_seen = False
    for module in modules:
        down, up = kohya[f"{prefix}{module}{down_key}"], kohya.get(f"{prefix}{module}.lora_up.weight")
        if up is None:
            continue
        alpha = kohya.get(f"{prefix}{module}.alpha")
        scale = (float(alpha) if alpha is not None else down.shape[0]) / down.shape[0]
        hit = next(((found, rule) for pattern, rule in targets if (found := pattern.match(module))), None)
        if hit is not None:
            found, rule = hit
            block = found.group(1) if found.groups() else ""
            sources = [source.replace("{i}", block) for source in rule.sources]
            fused_seen = True
        else:
            sources = [underscored.get(module, f"{prefix}{module}")]
        widths = [linears.get(source) for source in sources]
        if any(w is None for w in widths) or sum(widths) != up.shape[0]:  # type: ignore[arg-type]
            converted[f"{prefix}{module}.lora_A.weight"], converted[f"{prefix}{module}.lora_B.weight"] = down, up
            continue
        offset = 0
        for source, width in zip(sources, widths, strict=True):
            converted[f"{source}{_A}"] = down * scale
            converted[f"{source}{_B}"] = up[offset:offset + width]  # type: ignore[operator]
            offset += width  # type: ignore[operator]
    return converted if fused_seen else None


def _put(kohya: dict[str, torch.Tensor], name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> None:
    kohya[f"{name}.lora_down.weight"] = down.contiguous()
    kohya[f"{name}.lora_up.weight"] = up.contiguous()
    kohya[f"{name}.alpha"] = torch.tensor(float(alpha))


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
) -> dict[str, str]:
    """The adapter in diffusers' key format (``transformer.<module>.lora_A.weight``,
    what diffusers' own training scripts write; loads with ``load_lora_weights``)."""
    from safetensors.torch import save_file

    output_dir.mkdir(parents=True, exist_ok=True)
    state = registry.lora_state_dict(plan.family, denoiser)  # engine_lora_state_dict
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    prefix = plan.family.denoiser
    saver = getattr(type(pipe), "save_lora_weights", None)
    lora_path = output_dir / LORA_WEIGHTS
    if saver is not None:
        saver(str(output_dir), **{f"{prefix}_lora_layers": state}, **_adapter_metadata(saver, prefix, denoiser),
              weight_name=LORA_WEIGHTS)
    else:
        save_file({f"{prefix}.{k}": v for k, v in state.items()}, str(lora_path))
    outputs = {"lora": str(lora_path)}
    if plan.config.export_kohya:
        outputs["lora_kohya"] = str(export_kohya(plan, denoiser, state, output_dir))
    return outputs


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
