"""How a load's LoRAs are applied: the plan's ``lora`` control.

Torch-free, like the rest of the policy layer. The planner sees the LoRAs as
their headers describe them (:class:`LoraPlanInput`, built by
:mod:`engine.preflight.lora`); :func:`resolve_lora` picks fused, unfused or
hot-swapped application from them, the base's scheme and whether compile is
on, consulting the compatibility table for the pairs it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.policy.compatibility import pair_refusal
from engine.policy.resolved import Resolved, auto
from engine.requests.inference import LoraPlanInput


def resolve_lora(loras: LoraPlanInput, *, quantised: str | None, compiled: bool, dtype: str = "fp32") -> Resolved[str]:
    """How LoRAs are applied: ``fused`` into the weights (one LoRA on a dense fp32
    base, no switch expected: no per-step cost), ``unfused`` (peft layers beside
    the base: a quantised or GGUF base, several LoRAs, switching, or bf16 / fp16 weights,
    which a fused LoRA rounds and an unfuse cannot give back), or
    ``hotswap`` (unfused, in slots of the largest rank, so a compiled
    denoiser swaps adapters without recompiling)."""
    if loras.count == 0:
        return auto("none", "no LoRA requested")
    why = []
    base = {"GGUF": "gguf"}.get(quantised or "none", quantised or "none")
    unfusable = pair_refusal("lora", "fused", "quant", base)
    if quantised and unfusable:
        why.append(f"the base is {quantised} ({unfusable})")
    if loras.count > 1:
        why.append(f"{loras.count} LoRAs keep separate scales")
    if loras.switching:
        why.append("LoRAs will be switched on the loaded pipeline")
    if dtype in ("bf16", "fp16") and not why:
        why.append(f"fused into {dtype} weights a LoRA rounds them, and taking it out again would not give them "
                   "back (a later change of LoRA would leave the base model altered)")
    if compiled and pair_refusal("lora", "unfused", "compile", "regional"):
        because = "; ".join(why) or "compile is on"
        return auto("hotswap", f"{because}: adapters are hot-swapped in rank-{loras.max_rank} slots so a switch does not recompile")
    if why:
        return auto("unfused", "; ".join(why) + ": adapters stay beside the base weights")
    return auto("fused", "one LoRA on a dense fp32 base: fused into the weights, no per-step cost")
