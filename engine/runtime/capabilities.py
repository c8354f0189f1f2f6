"""What a loaded pipeline's classes can really do, checked against the table.

A family's table may declare its capabilities (:class:`~engine.contract.types.Capabilities`);
a declared ``False`` already turned the optimisation off in the plan. At load
the runtime checks every capability on the real classes, whatever was
declared, so a plan never relies on a method the class lacks: where a
capability is missing, the session adapts the plan with the reason
(``step_cache: off - the denoiser has no cache hooks``) instead of failing
with an ``AttributeError`` at the first generate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.policy.plan import Plan
from engine.policy.resolved import Resolved
from engine.contract.types import CAPABILITIES, FamilySpec


@dataclass(frozen=True)
class CapabilityCheck:
    """One capability: what the table declared, what the loaded class has, and why."""

    name: str
    #: The table's word (None: undeclared).
    declared: bool | None
    #: What the loaded classes really support.
    verified: bool
    #: What was found, in words a plan reason can quote.
    detail: str

    @property
    def contradicts(self) -> bool:
        """The table declared it and the class disagrees."""
        return self.declared is not None and self.declared != self.verified

    def to_dict(self) -> dict[str, object]:
        return {"declared": self.declared, "verified": self.verified, "detail": self.detail}


def verify(family: FamilySpec, pipe: Any, compile_regions: tuple[str, ...]) -> dict[str, CapabilityCheck]:
    """Every capability of ``family`` checked on the loaded ``pipe``."""
    denoiser = getattr(pipe, family.pipeline.denoiser)
    found = {
        "step_cache": _cache_hooks(denoiser),
        "attention_dispatcher": _attention_dispatcher(denoiser),
        "peft_adapters": _peft_adapters(denoiser),
        "regional_compile": _compile_regions(denoiser, compile_regions),
        "pipeline_lora": _pipeline_lora(pipe, family.pipeline.denoiser, denoiser),
    }
    declared = family.capabilities.declared()
    return {
        name: CapabilityCheck(name, declared[name], found[name][0], found[name][1])
        for name in CAPABILITIES
    }


def adapt_plan(plan: Plan, checks: Mapping[str, CapabilityCheck]) -> Plan:
    """``plan`` with every choice the loaded classes cannot carry turned off,
    each with the reason (the step cache is re-decided per generate, from
    :func:`step_cache_unsupported`)."""
    attention = plan.controls.get("attention_backend")
    dispatcher = checks["attention_dispatcher"]
    if attention is not None and attention.value != "native" and not dispatcher.verified:
        plan = plan.with_control("attention_backend", Resolved(
            "native", attention.source, f"{attention.value} not set: {dispatcher.detail}; native SDPA"
        ))
        plan = dataclasses.replace(plan, attention_install=None)
    compiled = plan.controls.get("compile")
    regions = checks["regional_compile"]
    if compiled is not None and compiled.value == "regional" and not regions.verified:
        plan = plan.with_control("compile", Resolved("off", compiled.source, f"off: {regions.detail}"))
    lora = plan.controls.get("lora")
    loader = checks["pipeline_lora"]
    if lora is not None and lora.value in ("fused", "hotswap") and not loader.verified:
        plan = plan.with_control("lora", Resolved(
            "unfused", lora.source, f"unfused: {lora.value} needs diffusers' LoRA loader and {loader.detail}"
        ))
    return plan


def step_cache_unsupported(checks: Mapping[str, CapabilityCheck] | None) -> str | None:
    """Why the loaded denoiser cannot carry the step cache, or None."""
    if checks is None or checks["step_cache"].verified:
        return None
    return checks["step_cache"].detail


def to_dict(checks: Mapping[str, CapabilityCheck]) -> dict[str, object]:
    return {name: check.to_dict() for name, check in checks.items()}


# -- the checks: (supported, what was found) -------------------------------------


def _class_name(obj: Any) -> str:
    return type(obj).__name__


def _cache_hooks(denoiser: Any) -> tuple[bool, str]:
    has = all(callable(getattr(denoiser, m, None)) for m in ("enable_cache", "disable_cache"))
    if has:
        return True, f"{_class_name(denoiser)} has diffusers' cache hooks"
    return False, f"the denoiser ({_class_name(denoiser)}) has no cache hooks (enable_cache)"


def _attention_dispatcher(denoiser: Any) -> tuple[bool, str]:
    """diffusers sets a backend only on attention processors that carry an
    ``_attention_backend`` slot; elsewhere ``set_attention_backend`` is a
    silent no-op, so this looks for at least one such processor."""
    if not callable(getattr(denoiser, "set_attention_backend", None)):
        return False, f"the denoiser ({_class_name(denoiser)}) has no set_attention_backend"
    processors = [
        getattr(module, "processor", None)
        for module in denoiser.modules()
        if getattr(module, "processor", None) is not None
    ]
    if any(hasattr(p, "_attention_backend") for p in processors):
        return True, "its attention processors use diffusers' attention dispatcher"
    kinds = sorted({_class_name(p) for p in processors}) or ["none"]
    return False, (
        f"the denoiser's attention processors ({', '.join(kinds)}) do not use diffusers' "
        "attention dispatcher, so a backend would not reach them"
    )


def _peft_adapters(denoiser: Any) -> tuple[bool, str]:
    if all(callable(getattr(denoiser, m, None)) for m in ("add_adapter", "load_lora_adapter")):
        return True, f"{_class_name(denoiser)} has diffusers' peft integration"
    return False, (
        f"the denoiser ({_class_name(denoiser)}) has no peft integration (add_adapter); "
        "LoRAs go through the engine_lora_* hooks"
    )


def _compile_regions(denoiser: Any, regions: tuple[str, ...]) -> tuple[bool, str]:
    if not regions:
        return False, "the family names no compile regions"
    present = sorted({type(m).__name__ for m in denoiser.modules()} & set(regions))
    if present:
        return True, f"the denoiser holds {', '.join(present)} blocks"
    return False, f"the denoiser holds none of the compile regions ({', '.join(regions)})"


def _pipeline_lora(pipe: Any, denoiser_name: str, denoiser: Any) -> tuple[bool, str]:
    loader = getattr(type(pipe), "load_lora_weights", None)
    if loader is None or not callable(getattr(type(pipe), "lora_state_dict", None)):
        return False, f"{_class_name(pipe)} has no LoRA loader mixin (load_lora_weights)"
    if denoiser_name not in getattr(pipe, "_lora_loadable_modules", ()):
        return False, f"{_class_name(pipe)}'s LoRA loader does not load into {denoiser_name}"
    if not callable(getattr(denoiser, "load_lora_adapter", None)):
        return False, (
            f"{_class_name(pipe)}.load_lora_weights needs the denoiser's load_lora_adapter, "
            f"which {_class_name(denoiser)} lacks"
        )
    return True, f"{_class_name(pipe)} loads LoRAs with diffusers' load_lora_weights"
