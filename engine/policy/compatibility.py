"""Which inference options work together: one table, pure, torch-free.

Six axes (transformer scheme, memory mode, compile, LoRA mode, attention
backend, step cache). Every pair of values on two axes is either allowed or
refused with the reason the combination fails at run time. The planner asks
this table (:func:`pair_refusal`) wherever one choice constrains another, the
loader re-checks a finished plan (:func:`plan_refusals`) before it touches the
GPU, and ``docs/compatibility.md`` is generated from it (:func:`markdown`).

Only measured or documented failures are refused; a pair the table does not
name is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from engine.contract.schemes import SCHEMES, TORCHAO_SCHEMES
from engine.contract.types import ATTENTION_KERNELS

if TYPE_CHECKING:  # the plan imports this module; only its type is needed here
    from engine.policy.plan import Plan

#: Transformer weights, as loaded (``none``: dense in the compute dtype).
QUANTS: tuple[str, ...] = ("none", "gguf", *(name for name in SCHEMES if name != "bf16"))
#: Schemes stored by another library, read as stored (a LoRA stays beside their layers).
LIBRARY_SCHEMES: tuple[str, ...] = tuple(n for n, s in SCHEMES.items() if s.backend in ("sdnq", "nunchaku"))
OFFLOADS: tuple[str, ...] = ("model_offload", "group_offload", "sequential_offload")

#: Axis name -> its values. ``compile``: ``fullgraph`` is a regional compile
#: with fullgraph on; ``step_cache``: ``fbcache`` wherever the cache can engage
#: during the session (pinned on, or auto and able to engage at some generate).
AXES: Mapping[str, tuple[str, ...]] = {
    "quant": QUANTS,
    "memory": ("resident", *OFFLOADS),
    "compile": ("off", "regional", "fullgraph"),
    "lora": ("none", "fused", "unfused", "hotswap"),
    "attention": ("native", *ATTENTION_KERNELS),
    "step_cache": ("off", "fbcache"),
}


@dataclass(frozen=True)
class Rule:
    """Every value in ``left`` on axis ``left_axis`` with every value in ``right``
    on ``right_axis`` is refused, for ``reason``."""

    left_axis: str
    left: tuple[str, ...]
    right_axis: str
    right: tuple[str, ...]
    reason: str


RULES: tuple[Rule, ...] = (
    Rule("quant", TORCHAO_SCHEMES, "memory", ("group_offload",),
         "group offload's CUDA streams clash with torchao-quantised weights; use sequential_offload"),
    Rule("compile", ("fullgraph",), "step_cache", ("fbcache",),
         "First-Block-Cache hooks the transformer's blocks: under a fullgraph-compiled transformer it crashes"),
    Rule("compile", ("fullgraph",), "memory", OFFLOADS,
         "offload hooks run inside the denoiser: a fullgraph compile fails at the first step"),
    Rule("compile", ("fullgraph",), "quant", ("gguf",),
         "GGUF weights dequantise per call inside the blocks: regional compile only, without fullgraph"),
    Rule("lora", ("fused",), "quant", ("gguf", "nf4", *TORCHAO_SCHEMES, *LIBRARY_SCHEMES),
         "a LoRA cannot be fused into quantised weights; it stays beside them (unfused)"),
    Rule("lora", ("fused", "unfused"), "compile", ("regional", "fullgraph"),
         "changing adapters on a compiled denoiser recompiles it; compiled LoRAs are hot-swapped in slots"),
)


def _check(axis: str, value: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(AXES)}")
    if value not in AXES[axis]:
        raise ValueError(f"{axis} {value!r} is not one of {', '.join(AXES[axis])}")


def pair_refusal(axis_a: str, value_a: str, axis_b: str, value_b: str) -> str | None:
    """Why ``axis_a=value_a`` with ``axis_b=value_b`` fails, or None (allowed)."""
    _check(axis_a, value_a)
    _check(axis_b, value_b)
    for rule in RULES:
        for (la, lv), (ra, rv) in (((axis_a, value_a), (axis_b, value_b)), ((axis_b, value_b), (axis_a, value_a))):
            if rule.left_axis == la and lv in rule.left and rule.right_axis == ra and rv in rule.right:
                return rule.reason
    return None


def refusals(combination: Mapping[str, str]) -> tuple[str, ...]:
    """Every refused pair in ``combination`` (axis -> value), as
    ``"a=x with b=y: reason"``; empty when the combination runs."""
    found = []
    for (axis_a, a), (axis_b, b) in combinations(combination.items(), 2):
        reason = pair_refusal(axis_a, a, axis_b, b)
        if reason:
            found.append(f"{axis_a}={a} with {axis_b}={b}: {reason}")
    return tuple(found)


def plan_combination(plan: Plan) -> dict[str, str]:
    """The combination a plan runs, on the table's axes."""
    quant = plan.value("transformer_quant")
    compiled = plan.value("compile") == "regional"
    return {
        "quant": str(quant) if quant else ("gguf" if plan.gguf else "none"),
        "memory": str(plan.value("memory_mode")),
        "compile": ("fullgraph" if plan.compile_fullgraph else "regional") if compiled else "off",
        "lora": str(plan.value("lora")),
        "attention": str(plan.value("attention_backend")),
        "step_cache": "fbcache" if plan.value("step_cache") != "off" or plan.step_cache_may_engage else "off",
    }


def plan_refusals(plan: Plan) -> tuple[str, ...]:
    """:func:`refusals` of the combination ``plan`` runs (its fallback is checked on its own)."""
    return refusals(plan_combination(plan))


def markdown() -> str:
    """``docs/compatibility.md``: the axes, then every refused pair with its reason."""
    lines = [
        "# Compatibility of inference options",
        "",
        "Generated from `engine/policy/compatibility.py` (`python -m engine.policy.compatibility`",
        "rewrites this file; a test fails when the two differ). The planner consults this table",
        "and the loader re-checks every plan against it before loading.",
        "",
        "## Axes",
        "",
        "| axis | values |",
        "|---|---|",
        *(f"| {axis} | {', '.join(f'`{v}`' for v in values)} |" for axis, values in AXES.items()),
        "",
        "`compile=fullgraph` is a regional compile with fullgraph on; `step_cache=fbcache` counts",
        "wherever the cache can engage during the session (pinned on, or auto on a long schedule).",
        "",
        "## Refused pairs",
        "",
        "Every pair not listed here is allowed.",
        "",
        "| option | with | reason |",
        "|---|---|---|",
    ]
    for axis_a, axis_b in combinations(AXES, 2):
        for a in AXES[axis_a]:
            for b in AXES[axis_b]:
                reason = pair_refusal(axis_a, a, axis_b, b)
                if reason:
                    lines.append(f"| {axis_a}=`{a}` | {axis_b}=`{b}` | {reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # regenerate the doc: python -m engine.policy.compatibility [path]
    import sys
    from pathlib import Path

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/compatibility.md")
    target.write_text(markdown(), encoding="utf-8")
