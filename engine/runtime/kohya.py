"""The kohya / ComfyUI LoRA key layout, both ways: a run's export and a downloaded file's load.

kohya's sd-scripts and ComfyUI name a LoRA's modules ``lora_unet_<module>``
(``.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``), with the original
checkpoint's module names where they differ from diffusers' (the family's
``lora_kohya_map``: one rule may fuse several diffusers Linears into one
original Linear, e.g. q, k and v into ``qkv``); other modules keep their
diffusers path with dots turned into underscores.

:func:`kohya_state_dict` writes that layout from peft keys (a fused module
stacks the parts' LoRAs block-diagonally, ``alpha`` scaled by the number of
parts, so the fused delta equals the parts' deltas exactly);
:func:`diffusers_from_kohya` reads it back, splitting a fused ``up`` by the
model's own widths. Here, under the runtime, because both the trainer's export
(:mod:`engine.training.export`) and the LoRA loader (:mod:`engine.runtime.lora`)
use it, and the runtime never imports the trainer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from engine.contract.types import FamilySpec

_A, _B = ".lora_A.weight", ".lora_B.weight"
#: What a kohya / ComfyUI LoRA's denoiser keys start with (``lora_unet_<module>``).
KOHYA_PREFIX = "lora_unet_"


def is_kohya(keys: Iterable[str]) -> bool:
    """Whether a LoRA's ``keys`` are in the kohya layout (any names a denoiser module so)."""
    return any(key.startswith(KOHYA_PREFIX) for key in keys)

#: The out features of a module of the denoiser (for parts the run did not adapt).
OutFeatures = Callable[[str], int]


def _template(name: str) -> re.Pattern[str]:
    """A ``kohya_map`` module name (``blocks.{i}.attn``) as a pattern whose group is the block index."""
    return re.compile("^" + re.escape(name).replace(r"\{i\}", r"(\d+)") + "$")


@dataclass(frozen=True)
class _Rule:
    target: str
    sources: tuple[str, ...]

    def match(self, module: str) -> tuple[int, str] | None:
        """(which source, block index) when ``module`` is one of this rule's sources."""
        for position, source in enumerate(self.sources):
            found = _template(source).match(module)
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
            _put(kohya, KOHYA_PREFIX + module.replace(".", "_"), state[module + _A], state[module + _B], alpha)
            continue
        rule_index, (position, block) = hit
        groups.setdefault((rule_index, block), {})[position] = module
    for (rule_index, block), parts in groups.items():
        rule = rules[rule_index]
        name = KOHYA_PREFIX + rule.target.replace("{i}", block)
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
    when it names no module of the family's ``kohya_map`` and not every module it names is the
    model's own (diffusers' own converters read it).

    The inverse of :func:`kohya_state_dict`, with the widths taken from the model
    (``linears``: every Linear of the denoiser and its out features), never assumed: a
    fused module's ``up`` is split by the parts' widths, each part keeping the whole
    ``down``, so each part's delta is exactly its rows of the fused delta (true for any
    fused LoRA, block-diagonal or not). ``alpha / rank`` is folded into ``down``. A
    module the model does not have (or whose widths differ) keeps its kohya name, so the
    caller's match check names it.
    """
    rules = [_Rule(target, sources) for target, sources in family.lora.kohya_map]
    prefix, down_key = KOHYA_PREFIX, ".lora_down.weight"
    modules = sorted(k[len(prefix):-len(down_key)] for k in kohya if k.startswith(prefix) and k.endswith(down_key))
    targets = [(_template(rule.target), rule) for rule in rules]
    underscored = {name.replace(".", "_"): name for name in linears}
    converted: dict[str, torch.Tensor] = {}
    fused_seen, all_found = False, bool(modules)
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
            all_found = False
            continue
        offset = 0
        for source, width in zip(sources, widths, strict=True):
            converted[f"{source}{_A}"] = down * scale
            converted[f"{source}{_B}"] = up[offset:offset + width]  # type: ignore[operator]
            offset += width  # type: ignore[operator]
    # Read here where a fused module needed the model's widths, or where every module is one of the
    # model's own under its underscored name (a family whose kohya names are its diffusers names, which
    # diffusers' converter for it may not read); else diffusers' converters read the file.
    return converted if fused_seen or all_found else None


def _put(kohya: dict[str, torch.Tensor], name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> None:
    kohya[f"{name}.lora_down.weight"] = down.contiguous()
    kohya[f"{name}.lora_up.weight"] = up.contiguous()
    kohya[f"{name}.alpha"] = torch.tensor(float(alpha))
