"""The compatibility table: the doc is generated from it, the planner never
produces a combination it refuses, and the loader refuses one it is handed."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from engine.errors import EngineError, PreflightError
from engine.hardware.presets import PRESETS
from engine.contract.plugins import load_registry
from engine.policy import compatibility
from engine.policy.compatibility import AXES, pair_refusal, plan_combination, plan_refusals
from engine.policy.inference import InferenceRequest, LoraPlanInput, ModelFacts, Plan, plan_inference
from engine.policy.speed import ATTENTION_BACKENDS
from engine.runtime.session import InferenceSession

REGISTRY = load_registry()
DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"

QUANTS = ("auto", "none", "nf4", "int8", "fp8", "mxfp8", "nvfp4")
MEMORY = ("auto", "resident", "model_offload", "group_offload", "sequential_offload")
COMPILE = ("auto", "on", "off")
CACHE = ("auto", "off", "fbcache")
LORAS = {
    "none": LoraPlanInput(),
    "one": LoraPlanInput(count=1, max_rank=16, params=1_000_000),
    "switching": LoraPlanInput(count=2, max_rank=32, params=2_000_000, switching=True),
}
ATTENTION = ATTENTION_BACKENDS


def test_the_doc_is_generated_from_the_table() -> None:
    assert DOC.read_text(encoding="utf-8") == compatibility.markdown(), (
        "docs/compatibility.md is stale: run python -m engine.policy.compatibility"
    )


def test_pairs_are_symmetric_and_names_are_checked() -> None:
    for (axis_a, values_a), (axis_b, values_b) in itertools.combinations(AXES.items(), 2):
        for a, b in itertools.product(values_a, values_b):
            assert pair_refusal(axis_a, a, axis_b, b) == pair_refusal(axis_b, b, axis_a, a)
    assert pair_refusal("quant", "int8", "memory", "group_offload")
    assert pair_refusal("quant", "int8", "memory", "sequential_offload") is None
    with pytest.raises(ValueError, match="not one of"):
        pair_refusal("quant", "int3", "memory", "resident")


def facts(family: str, gguf_gb: float | None = None) -> ModelFacts:
    spec = REGISTRY.family(family)
    chosen = spec.default_checkpoint
    return ModelFacts(spec, chosen, REGISTRY.component_sizes(spec, chosen), gguf_transformer_gb=gguf_gb)


def planned(model: ModelFacts, hardware: str, request: InferenceRequest) -> list[Plan]:
    """The plan and its fallback; none when the planner refuses (with a code)."""
    try:
        result = plan_inference(REGISTRY, model, PRESETS[hardware], request, env={})
    except PreflightError as exc:
        # A refusal of the request is fine; the planner tripping over its own
        # combination (its last check against the table) is the bug.
        assert exc.code not in ("incompatible_plan", "preflight_failed"), exc.message
        return []
    return [result, *([result.fallback] if result.fallback else [])]


@pytest.mark.parametrize(
    ("family", "gguf_gb", "hardware"),
    [("flux", None, "h100"), ("flux", None, "rtx4090"), ("flux", 12.7, "rtx4090"),
     ("sdxl", None, "t4"), ("qwen_image", None, "rtx5090")],
)
def test_no_request_combination_plans_what_the_table_refuses(family: str, gguf_gb: float | None, hardware: str) -> None:
    """Every quant x memory x compile x step cache x LoRA request: each plan
    (and fallback) the planner returns is a combination the table allows."""
    model = facts(family, gguf_gb)
    seen: set[tuple[str, ...]] = set()
    for quant, memory, compiled, cache, lora in itertools.product(QUANTS, MEMORY, COMPILE, CACHE, LORAS):
        request = InferenceRequest(
            quant=quant, memory=memory, compile=compiled, step_cache=cache, loras=LORAS[lora]
        )
        for result in planned(model, hardware, request):
            assert plan_refusals(result) == (), (quant, memory, compiled, cache, lora)
            seen.add(tuple(plan_combination(result).values()))
    assert len(seen) > 10  # the enumeration reached many distinct plans


@pytest.mark.parametrize("hardware", ["h100", "rtx4090"])
def test_no_attention_request_plans_what_the_table_refuses(hardware: str) -> None:
    model = facts("flux")
    for attention, compiled, cache in itertools.product(ATTENTION, COMPILE, CACHE):
        request = InferenceRequest(attention=attention, compile=compiled, step_cache=cache)
        for result in planned(model, hardware, request):
            assert plan_refusals(result) == (), (attention, compiled, cache)


def test_the_loader_refuses_a_plan_the_table_refuses_before_loading() -> None:
    good = plan_inference(REGISTRY, facts("flux"), PRESETS["rtx4090"], InferenceRequest(memory="group_offload", speed="default"),
                          env={})
    assert plan_refusals(good) == ()
    bad = dataclasses.replace(good, compile_fullgraph=True, step_cache_may_engage=False)
    assert bad.value("compile") == "regional"
    with pytest.raises(EngineError) as refused:
        # No source is read: the plan is refused first.
        InferenceSession(REGISTRY, None, bad).load()  # type: ignore[arg-type]
    assert refused.value.code == "incompatible_plan"
    assert "memory=group_offload with compile=fullgraph" in refused.value.message
