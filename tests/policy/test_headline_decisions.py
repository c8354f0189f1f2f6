"""The headline decisions, value by value: dtype, denoiser scheme and memory mode for every
built-in family's default checkpoint on every preset, against a table a reviewer reads.

The wide matrix (tests/policy/test_inference_policy.py) checks that every preset x family x scheme
plans with a reason; this one checks what it plans. Each column is one test named by its
rule, and a wrong value fails it once, listing every cell it moved ("t4/flux: fp16 planned
fp32"), so a planted wrong default fails a handful of tests whose names say the rule, not
hundreds of rows. A change of decision is a change of this table, read in review.
"""

from __future__ import annotations

import pytest

from engine.contract.plugins import load_registry
from engine.errors import PreflightError
from engine.hardware.presets import PRESETS
from engine.policy.inference import InferenceRequest, ModelFacts, plan_inference

REGISTRY = load_registry()
FAMILIES = ("flux", "flux2", "hunyuan_video", "qwen_image", "sdxl", "wan", "zimage")

#: (preset, family) -> (dtype, denoiser scheme, memory mode); a refusal is ("refused", code, "-").
EXPECTED: dict[tuple[str, str], tuple[str, str, str]] = {
    ("a100-40g", "flux"): ("bf16", "dense", "resident"),
    ("a100-40g", "flux2"): ("bf16", "dense", "resident"),
    ("a100-40g", "hunyuan_video"): ("bf16", "int8", "resident"),
    ("a100-40g", "qwen_image"): ("bf16", "dense", "group_offload"),
    ("a100-40g", "sdxl"): ("bf16", "dense", "resident"),
    ("a100-40g", "wan"): ("bf16", "dense", "resident"),
    ("a100-40g", "zimage"): ("bf16", "dense", "resident"),
    ("a100-80g", "flux"): ("bf16", "dense", "resident"),
    ("a100-80g", "flux2"): ("bf16", "dense", "resident"),
    ("a100-80g", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("a100-80g", "qwen_image"): ("bf16", "dense", "resident"),
    ("a100-80g", "sdxl"): ("bf16", "dense", "resident"),
    ("a100-80g", "wan"): ("bf16", "dense", "resident"),
    ("a100-80g", "zimage"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "flux"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "flux2"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "qwen_image"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "sdxl"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "wan"): ("bf16", "dense", "resident"),
    ("apple-m3-max", "zimage"): ("bf16", "dense", "resident"),
    ("b200", "flux"): ("bf16", "dense", "resident"),
    ("b200", "flux2"): ("bf16", "dense", "resident"),
    ("b200", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("b200", "qwen_image"): ("bf16", "dense", "resident"),
    ("b200", "sdxl"): ("bf16", "dense", "resident"),
    ("b200", "wan"): ("bf16", "dense", "resident"),
    ("b200", "zimage"): ("bf16", "dense", "resident"),
    ("cpu", "flux"): ("refused", "insufficient_memory", "-"),
    ("cpu", "flux2"): ("bf16", "dense", "resident"),
    ("cpu", "hunyuan_video"): ("refused", "insufficient_memory", "-"),
    ("cpu", "qwen_image"): ("refused", "insufficient_memory", "-"),
    ("cpu", "sdxl"): ("fp32", "dense", "resident"),
    ("cpu", "wan"): ("refused", "insufficient_memory", "-"),
    ("cpu", "zimage"): ("refused", "insufficient_memory", "-"),
    ("dgx-spark", "flux"): ("bf16", "dense", "resident"),
    ("dgx-spark", "flux2"): ("bf16", "dense", "resident"),
    ("dgx-spark", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("dgx-spark", "qwen_image"): ("bf16", "dense", "resident"),
    ("dgx-spark", "sdxl"): ("bf16", "dense", "resident"),
    ("dgx-spark", "wan"): ("bf16", "dense", "resident"),
    ("dgx-spark", "zimage"): ("bf16", "dense", "resident"),
    ("h100", "flux"): ("bf16", "dense", "resident"),
    ("h100", "flux2"): ("bf16", "dense", "resident"),
    ("h100", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("h100", "qwen_image"): ("bf16", "dense", "resident"),
    ("h100", "sdxl"): ("bf16", "dense", "resident"),
    ("h100", "wan"): ("bf16", "dense", "resident"),
    ("h100", "zimage"): ("bf16", "dense", "resident"),
    ("h200", "flux"): ("bf16", "dense", "resident"),
    ("h200", "flux2"): ("bf16", "dense", "resident"),
    ("h200", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("h200", "qwen_image"): ("bf16", "dense", "resident"),
    ("h200", "sdxl"): ("bf16", "dense", "resident"),
    ("h200", "wan"): ("bf16", "dense", "resident"),
    ("h200", "zimage"): ("bf16", "dense", "resident"),
    ("l40s", "flux"): ("bf16", "dense", "resident"),
    ("l40s", "flux2"): ("bf16", "dense", "resident"),
    ("l40s", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("l40s", "qwen_image"): ("bf16", "fp8", "resident"),
    ("l40s", "sdxl"): ("bf16", "dense", "resident"),
    ("l40s", "wan"): ("bf16", "dense", "resident"),
    ("l40s", "zimage"): ("bf16", "dense", "resident"),
    ("mi300x", "flux"): ("bf16", "dense", "resident"),
    ("mi300x", "flux2"): ("bf16", "dense", "resident"),
    ("mi300x", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("mi300x", "qwen_image"): ("bf16", "dense", "resident"),
    ("mi300x", "sdxl"): ("bf16", "dense", "resident"),
    ("mi300x", "wan"): ("bf16", "dense", "resident"),
    ("mi300x", "zimage"): ("bf16", "dense", "resident"),
    ("rtx-a4000", "flux"): ("bf16", "dense", "group_offload"),
    ("rtx-a4000", "flux2"): ("bf16", "int8", "resident"),
    ("rtx-a4000", "hunyuan_video"): ("bf16", "dense", "group_offload"),
    ("rtx-a4000", "qwen_image"): ("bf16", "dense", "group_offload"),
    ("rtx-a4000", "sdxl"): ("bf16", "dense", "resident"),
    ("rtx-a4000", "wan"): ("bf16", "dense", "resident"),
    ("rtx-a4000", "zimage"): ("bf16", "int8", "resident"),
    ("rtx2080ti", "flux"): ("fp16", "dense", "group_offload"),
    ("rtx2080ti", "flux2"): ("fp16", "dense", "group_offload"),
    ("rtx2080ti", "hunyuan_video"): ("refused", "no_safe_dtype", "-"),
    ("rtx2080ti", "qwen_image"): ("refused", "no_safe_dtype", "-"),
    ("rtx2080ti", "sdxl"): ("fp16", "dense", "resident"),
    ("rtx2080ti", "wan"): ("refused", "no_safe_dtype", "-"),
    ("rtx2080ti", "zimage"): ("refused", "no_safe_dtype", "-"),
    ("rtx3090", "flux"): ("bf16", "int8", "resident"),
    ("rtx3090", "flux2"): ("bf16", "dense", "resident"),
    ("rtx3090", "hunyuan_video"): ("bf16", "int8", "resident"),
    ("rtx3090", "qwen_image"): ("bf16", "dense", "group_offload"),
    ("rtx3090", "sdxl"): ("bf16", "dense", "resident"),
    ("rtx3090", "wan"): ("bf16", "dense", "resident"),
    ("rtx3090", "zimage"): ("bf16", "int8", "resident"),
    ("rtx4090", "flux"): ("bf16", "int8", "resident"),
    ("rtx4090", "flux2"): ("bf16", "dense", "resident"),
    ("rtx4090", "hunyuan_video"): ("bf16", "int8", "resident"),
    ("rtx4090", "qwen_image"): ("bf16", "dense", "group_offload"),
    ("rtx4090", "sdxl"): ("bf16", "dense", "resident"),
    ("rtx4090", "wan"): ("bf16", "dense", "resident"),
    ("rtx4090", "zimage"): ("bf16", "int8", "resident"),
    ("rtx5090", "flux"): ("bf16", "int8", "resident"),
    ("rtx5090", "flux2"): ("bf16", "dense", "resident"),
    ("rtx5090", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("rtx5090", "qwen_image"): ("bf16", "dense", "group_offload"),
    ("rtx5090", "sdxl"): ("bf16", "dense", "resident"),
    ("rtx5090", "wan"): ("bf16", "dense", "resident"),
    ("rtx5090", "zimage"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "flux"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "flux2"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "hunyuan_video"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "qwen_image"): ("bf16", "fp8", "resident"),
    ("rtx6000-ada", "sdxl"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "wan"): ("bf16", "dense", "resident"),
    ("rtx6000-ada", "zimage"): ("bf16", "dense", "resident"),
    ("t4", "flux"): ("fp16", "dense", "group_offload"),
    ("t4", "flux2"): ("fp16", "dense", "resident"),
    ("t4", "hunyuan_video"): ("refused", "no_safe_dtype", "-"),
    ("t4", "qwen_image"): ("refused", "no_safe_dtype", "-"),
    ("t4", "sdxl"): ("fp16", "dense", "resident"),
    ("t4", "wan"): ("refused", "no_safe_dtype", "-"),
    ("t4", "zimage"): ("refused", "no_safe_dtype", "-"),
    ("v100", "flux"): ("fp16", "dense", "group_offload"),
    ("v100", "flux2"): ("fp16", "dense", "resident"),
    ("v100", "hunyuan_video"): ("refused", "no_safe_dtype", "-"),
    ("v100", "qwen_image"): ("refused", "no_safe_dtype", "-"),
    ("v100", "sdxl"): ("fp16", "dense", "resident"),
    ("v100", "wan"): ("fp32", "dense", "resident"),
    ("v100", "zimage"): ("refused", "no_safe_dtype", "-"),
}
COLUMNS = {"dtype": 0, "scheme": 1, "memory": 2}


@pytest.fixture(scope="module")
def planned() -> dict[tuple[str, str], tuple[str, str, str]]:
    cells = {}
    for hw, family in EXPECTED:
        spec = REGISTRY.family(family)
        facts = ModelFacts(spec, spec.default_checkpoint, REGISTRY.component_sizes(spec))
        try:
            plan = plan_inference(REGISTRY, facts, PRESETS[hw], InferenceRequest(), env={})
        except PreflightError as refused:
            cells[hw, family] = ("refused", refused.code, "-")
            continue
        cells[hw, family] = (str(plan.value("dtype")), str(plan.value("transformer_quant") or "dense"),
                             str(plan.value("memory_mode")))
    return cells


def _moved(planned: dict[tuple[str, str], tuple[str, str, str]], column: str) -> list[str]:
    index = COLUMNS[column]
    return [f"{hw}/{family}: {want[index]} planned {planned[hw, family][index]}"
            for (hw, family), want in EXPECTED.items() if planned[hw, family][index] != want[index]]


def test_the_table_covers_every_preset_and_built_in_family() -> None:
    assert {hw for hw, _ in EXPECTED} == set(PRESETS) and {f for _, f in EXPECTED} == set(FAMILIES)


def test_dtype_is_native_bf16_else_fp16_else_a_refusal_for_fp16_unsafe_families(planned: dict) -> None:
    assert _moved(planned, "dtype") == []


def test_the_scheme_is_the_first_on_the_ladder_that_keeps_the_denoiser_resident(planned: dict) -> None:
    assert _moved(planned, "scheme") == []


def test_the_memory_mode_is_resident_where_the_model_fits_else_offloaded(planned: dict) -> None:
    assert _moved(planned, "memory") == []
