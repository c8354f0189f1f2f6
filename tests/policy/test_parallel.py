"""How one request splits across GPUs, decided before anything loads (engine.policy.parallel).

Planned on presets: the split is a pure function of the machine, the family's table and the
request, with its reason; a split that cannot work is refused naming what to do instead.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.contract.plugins import load_registry
from engine.errors import PreflightError
from engine.hardware.presets import preset
from engine.policy.inference import ModelFacts, plan_inference
from engine.policy.parallel import ParallelChoice, sequence_tokens
from engine.requests.inference import InferenceRequest

REGISTRY = load_registry()


def _plan(family: str, checkpoint: str | None, hardware: str, **asked: object):
    spec = REGISTRY.family(family)
    point = spec.checkpoint(checkpoint) if checkpoint else None
    facts = ModelFacts(spec, point, REGISTRY.component_sizes(spec, point))
    return plan_inference(REGISTRY, facts, preset(hardware), InferenceRequest(**asked))


def _refusal(family: str, checkpoint: str | None, hardware: str, **asked: object) -> PreflightError:
    with pytest.raises(PreflightError) as caught:
        _plan(family, checkpoint, hardware, **asked)
    assert caught.value.code == "parallel_unsupported"
    return caught.value


def test_wan_14b_at_720p_on_eight_h100s_splits_cfg_first_then_ulysses_over_its_40_heads() -> None:
    plan = _plan("wan", "wan2.1-t2v-14b", "8xh100", gpus=8, width=1280, height=720, frames=81)
    assert plan.parallel == ParallelChoice(8, cfg=2, ulysses=4, device="cuda")
    said = plan["parallel"]
    assert said.value == "cfg 2 x ulysses 4" and said.source == "auto"
    assert "40 heads, 10 a rank" in said.reason and "75600 tokens, 18900 a rank" in said.reason
    assert plan.value("step_cache") == "off"  # a split runs no step cache
    assert plan.to_dict()["parallel"]["label"] == "cfg 2 x ulysses 4"


def test_heads_that_do_not_divide_take_the_anything_variant() -> None:
    plan = _plan("wan", "wan2.1-t2v-14b", "8xh100", gpus=6, width=1280, height=720, frames=81)
    assert plan.parallel == ParallelChoice(6, cfg=2, ulysses=3, anything=True, device="cuda")
    assert "40 heads do not divide 3 ways: padded" in plan["parallel"].reason


def test_more_ranks_than_heads_rings_and_a_sequence_that_does_not_divide_rings_anything() -> None:
    # Wan 2.1 1.3B has 12 heads: 16 ranks cannot each take whole heads; guidance 1 leaves no CFG half
    plan = _plan("wan", "wan2.1-t2v-1.3b", "16xh100", gpus=16, guidance=(1.0,), width=832, height=480, frames=81)
    assert plan.parallel.ring == 16 and plan.parallel.cfg == 1
    tokens = sequence_tokens(REGISTRY.family("wan"), REGISTRY.family("wan").checkpoint("wan2.1-t2v-1.3b"),
                             InferenceRequest(width=832, height=480, frames=81))
    assert tokens == 21 * 52 * 30 and plan.parallel.anything == (tokens % 16 != 0)
    assert "12 heads cannot go 16 ways" in plan["parallel"].reason


def test_an_asked_kind_is_honoured_with_the_engines_degree() -> None:
    ring = _plan("wan", "wan2.1-t2v-14b", "8xh100", gpus=8, parallel="ring")
    assert ring.parallel == ParallelChoice(8, ring=8, device="cuda") and ring["parallel"].source == "explicit"
    assert not ring["parallel"].overridden
    cfg = _plan("wan", "wan2.1-t2v-14b", "2xh100", gpus=2, parallel="cfg")
    assert cfg.parallel == ParallelChoice(2, cfg=2, device="cuda")


def test_flux_splits_its_sequence_and_never_its_guidance() -> None:
    plan = _plan("flux", None, "4xh100", gpus=4)
    assert plan.parallel == ParallelChoice(4, ulysses=4, device="cuda")  # guidance is embedded: one pass a step
    assert "24 heads, 6 a rank" in plan["parallel"].reason
    refusal = _refusal("flux", None, "2xh100", gpus=2, parallel="cfg")
    assert "does not run its transformer once per condition" in refusal.message


@pytest.mark.parametrize(("asked", "words"), [
    ({"gpus": 16}, "more GPUs than this machine has (8)"),
    ({"gpus": 2, "parallel": "cfg", "guidance": (1.0,)}, "guidance 1 runs the transformer once a step"),
    ({"gpus": 2, "step_cache": "fbcache"}, "--step-cache fbcache cannot run split"),
    ({"gpus": 1, "parallel": "ring"}, "give --gpus 2"),
])
def test_a_split_that_cannot_work_is_refused_saying_what_instead(asked: dict[str, object], words: str) -> None:
    assert words in _refusal("wan", "wan2.1-t2v-14b", "8xh100", **asked).message


def test_a_two_expert_model_splits_cfg_only_where_both_experts_run_guidance() -> None:
    both = _plan("wan", "wan2.2-t2v-a14b", "2xh100", gpus=2)
    assert both.parallel.cfg == 2  # 4.0 and 3.0
    low_off = _plan("wan", "wan2.2-t2v-a14b", "2xh100", gpus=2, guidance=(4.0, 1.0))
    assert low_off.parallel == ParallelChoice(2, ulysses=2, device="cuda")


def test_a_denoiser_without_a_context_parallel_plan_is_refused_or_split_by_guidance() -> None:
    assert "declares no context-parallel plan" in _refusal("sdxl", None, "2xh100", gpus=2).message
    video = _plan("hunyuan_video", None, "2xh100", gpus=2)  # its guider runs each condition apart
    assert video.parallel == ParallelChoice(2, cfg=2, device="cuda")
    assert "give --gpus 2 for CFG parallel" in _refusal("hunyuan_video", None, "4xh100", gpus=4).message


def test_the_tables_declarations_are_what_allow_each_split() -> None:
    """The safeguards in the tables: drop Wan's context-parallel or CFG declaration and the split goes."""
    wan = REGISTRY.family("wan")
    assert wan.speed.context_parallel is True and wan.speed.cfg_parallel is True
    facts = ModelFacts(wan, wan.checkpoint("wan2.1-t2v-14b"), REGISTRY.component_sizes(wan, None))
    undeclared = dataclasses.replace(facts, family=dataclasses.replace(
        wan, speed=dataclasses.replace(wan.speed, context_parallel=None, cfg_parallel=False)))
    with pytest.raises(PreflightError):
        plan_inference(REGISTRY, undeclared, preset("8xh100"), InferenceRequest(gpus=8))
    cfg_only = dataclasses.replace(facts, family=dataclasses.replace(
        wan, speed=dataclasses.replace(wan.speed, context_parallel=None)))
    assert plan_inference(REGISTRY, cfg_only, preset("2xh100"), InferenceRequest(gpus=2)).parallel.cfg == 2


def test_cpu_ranks_are_processes_over_gloo_bounded_by_the_cores() -> None:
    plan = _plan("wan", "wan2.1-t2v-1.3b", "cpu", gpus=2)
    assert plan.parallel.device == "cpu" and "CPU processes over gloo" in plan["parallel"].reason
    assert "more than its 8 cores" in _refusal("wan", "wan2.1-t2v-1.3b", "cpu", gpus=16).message


def test_no_gpus_asked_plans_no_split() -> None:
    plan = _plan("wan", None, "8xh100")
    assert plan.parallel is None and plan["parallel"].value == "off"
    assert "--gpus N splits one request across N of its 8 GPUs" in plan["parallel"].reason
