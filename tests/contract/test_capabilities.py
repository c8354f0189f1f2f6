"""Capabilities checked, not assumed: a family whose denoiser lacks cache hooks,
the attention dispatcher and peft support plans, generates and trains
through the runtime hooks, with reasons in the plan and no AttributeError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.hardware.probe import probe
from engine.contract.plugins import Registry, load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.contract.types import ATTENTION_KERNELS
from engine.policy.info import training_info
from engine.policy.resolved import explicit
from engine.preflight.model import resolve_model
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.testing.run import RunReport, run_model
from engine.contract.types import Capabilities
from tests.capability_families import BARE, BareDenoiser, FixturePlugin


@pytest.fixture(scope="module")
def plugin() -> FixturePlugin:
    return FixturePlugin(BARE, BareDenoiser)


@pytest.fixture(scope="module")
def registry(plugin: FixturePlugin) -> Registry:
    return load_registry(plugins=[("bare", plugin)])


@pytest.fixture(scope="module")
def run(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> RunReport:
    """The kit's model run of the bare family: load, generate, train 2 steps, reload the LoRA."""
    return run_model(registry, registry.family("bare"), tmp_path_factory.mktemp("bare"))


def test_engine_lora_add_hook_lets_a_bare_family_generate_and_train(run: RunReport, plugin: FixturePlugin) -> None:
    assert run.failure is None, run.failure
    assert len(run.stages) == 4
    started = next(e for e in run.train_events if e["type"] == "started")
    assert started["lora_adapter"] == "the bare family's hook (peft inject_adapter_in_model)"
    assert {"lora_add", "lora_state_dict", "lora_load", "generate_kwargs"} <= set(plugin.calls)


def test_engine_lora_load_reloads_what_engine_lora_add_and_state_dict_saved(run: RunReport) -> None:
    """The saved file holds the hook's peft keys under the denoiser's prefix; the
    reload through ``engine_lora_load`` changed the image (the run's last stage)."""
    from safetensors.torch import load_file

    assert run.lora is not None
    keys = set(load_file(str(run.lora)))
    assert "transformer.block.to_q.lora_A.weight" in keys and "transformer.block.to_out.lora_B.weight" in keys
    assert run.stages[-1] == "reload the LoRA through the engine and generate"


def test_engine_lora_state_dict_and_add_defaults_need_nothing_from_the_class() -> None:
    """The engine's default hooks need nothing from the class: peft's generic injection."""
    import torch
    from peft import LoraConfig

    from engine.runtime import family_hooks

    registry = load_registry()
    family = registry.family("flux")
    module = torch.nn.Sequential()
    module.add_module("to_q", torch.nn.Linear(4, 4))
    how = family_hooks.lora_add(registry, family, module, LoraConfig(r=2, target_modules=["to_q"]))
    assert "inject_adapter_in_model" in how
    state = family_hooks.lora_state_dict(registry, family, module)
    assert set(state) == {"to_q.lora_A.weight", "to_q.lora_B.weight"}


def test_undeclared_capabilities_are_verified_at_load_and_reported(run: RunReport) -> None:
    capabilities = run.capabilities or {}
    assert {name: c["verified"] for name, c in capabilities.items()} == {  # type: ignore[index]
        "step_cache": False, "attention_dispatcher": False, "peft_adapters": False,
        "regional_compile": False, "pipeline_lora": False,
    }
    assert all(c["declared"] is None for c in capabilities.values())  # type: ignore[index]
    assert "no cache hooks" in capabilities["step_cache"]["detail"]  # type: ignore[index]


def test_engine_generate_kwargs_hook_sets_the_call(run: RunReport, plugin: FixturePlugin) -> None:
    assert plugin.calls.count("generate_kwargs") >= 2  # the base image and the LoRA image


def test_plan_adapts_with_reasons_when_the_classes_cannot(
    registry: Registry, run: RunReport, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Asked for sage attention, the step cache and regional compile, the load
    turns each off with the reason instead of crashing at the first step."""
    folder = registry.build_tiny_pipeline(registry.family("bare"), tmp_path_factory.mktemp("plan") / "bare")
    source = resolve_model(registry, str(folder), family="bare")
    request = InferenceRequest(width=64, height=64, step_cache="fbcache")
    plan = plan_inference(registry, source.facts(registry), probe(verify=False), request)
    plan = plan.with_control("attention_backend", explicit("sage"))
    plan = plan.with_control("step_cache", explicit("fbcache")).with_control("compile", explicit("regional"))
    session = InferenceSession(registry, source, plan, request, installer=lambda _: pytest.fail("no install"))
    session.load()
    try:
        session.generate(GenerateRequest(prompt="a test", steps=2, width=64, height=64))
        resolved = session.status()["plan"]["resolved"]  # type: ignore[index]
    finally:
        session.unload()
    assert resolved["attention_backend"]["value"] == "native"
    assert "attention dispatcher" in resolved["attention_backend"]["reason"]
    assert resolved["step_cache"]["value"] == "off"
    assert "no cache hooks" in resolved["step_cache"]["reason"]
    assert resolved["compile"]["value"] == "off"
    assert "compile regions" in resolved["compile"]["reason"]
    json.dumps(resolved)


def test_declared_missing_capabilities_turn_optimisations_off_before_load(registry: Registry) -> None:
    import dataclasses

    declared = dataclasses.replace(
        registry.family("bare"), capabilities=Capabilities(step_cache=False, attention_dispatcher=False)
    )
    denied = registry.optimization_deny(declared)
    assert "no cache hooks" in denied["step_cache"]
    assert set(ATTENTION_KERNELS) <= set(denied)
    assert "compile" not in denied


def test_info_calls_a_family_without_trainer_untrainable(registry: Registry) -> None:
    import dataclasses

    bare = registry.family("bare")
    untrainable = dataclasses.replace(bare, training=dataclasses.replace(bare.training, objective=None))
    assert training_info(registry, untrainable, probe(verify=False)).trainable is False


def test_a_bare_family_lora_is_checked_before_load_on_its_own_classes(
    registry: Registry, run: RunReport, tmp_path: Path
) -> None:
    """The pre-load LoRA check builds the family's own denoiser class on the meta
    device (found among imported modules, never imported on a folder's say-so)."""
    from engine.errors import EngineError
    from engine.preflight.lora import lora_choices, read_loras
    from engine.runtime.lora_check import check_loras
    from safetensors.torch import load_file, save_file

    assert run.lora is not None
    folder = run.lora.parents[1] / "tiny"
    source = resolve_model(registry, str(folder), family="bare")
    check_loras(registry, source, read_loras(lora_choices([str(run.lora)])))  # fits: no error
    wrong = {k.replace("block.to_q", "block.to_nowhere"): v for k, v in load_file(str(run.lora)).items()}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(EngineError, match="match nothing"):
        check_loras(registry, source, read_loras(lora_choices([str(tmp_path / "wrong.safetensors")])))


def test_a_family_with_no_runtime_module_generates_encoding_its_own_prompts(tmp_path: Path) -> None:
    """The contract's default (no runtime module) is a family whose pipeline encodes its own
    prompts: generate skips the prompt cache instead of importing a module named ''."""
    import dataclasses

    from engine import Engine
    from tests.capability_families import BareDenoiser

    spec = dataclasses.replace(BARE, name="plain", label="plain test family", runtime_module="",
                               training=dataclasses.replace(BARE.training, objective=None))
    spec = dataclasses.replace(spec, checkpoints=(dataclasses.replace(BARE.checkpoints[0], name="plain",
                                                                      matches=("*plain*",)),))
    registry = load_registry(plugins=[("plain", FixturePlugin(spec, BareDenoiser))])
    assert registry.family("plain").runtime_module == ""
    engine = Engine(registry=registry, hardware=probe(verify=False))
    folder = registry.build_tiny_pipeline(registry.family("plain"), tmp_path / "plain")
    engine.images.load(str(folder), family="plain")
    image = engine.images.generate("a red square", steps=2, width=64, height=64, seed=1)[0]
    assert image.size == (64, 64)
    engine.images.unload()
