"""The contract kit runs the model: it catches a family whose tiny pipeline
cannot generate, fails (not skips) a family with no tiny pipeline, accepts an
epsilon-predicting DiT, and runs in full for every installed third-party family."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.contract.plugins import Registry, load_registry
from engine.testing import FamilyContract
from engine.testing.contract import build_tiny_or_fail
from engine.testing.run import run_model
from engine.contract.types import TrainingObjective
from tests.capability_families import BROKEN, BrokenDenoiser, FixturePlugin


@pytest.fixture(scope="module")
def broken() -> Registry:
    return load_registry(plugins=[("broken", FixturePlugin(BROKEN, BrokenDenoiser))])


@pytest.fixture(scope="module")
def broken_folder(broken: Registry, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return broken.build_tiny_pipeline(broken.family("broken"), tmp_path_factory.mktemp("broken") / "tiny")


def test_kit_catches_a_family_whose_tiny_pipeline_fails_to_generate(
    broken: Registry, broken_folder: Path, tmp_path: Path
) -> None:
    family = broken.family("broken")
    report = run_model(broken, family, tmp_path, folder=broken_folder)
    assert report.stages == ["build the tiny pipeline"]
    assert report.failure is not None and report.failure.startswith("load and generate through the engine failed")
    with pytest.raises(AssertionError, match="load and generate"):
        FamilyContract().test_runs_the_model(broken, family, broken_folder, tmp_path)


def test_kit_fails_a_family_with_no_tiny_pipeline_with_what_to_add(tmp_path: Path) -> None:
    registry = load_registry()
    bare = dataclasses.replace(registry.family("flux"), tiny_pipeline="")
    with pytest.raises(pytest.fail.Exception, match="set FamilySpec.tiny_pipeline"):
        build_tiny_or_fail(registry, bare, tmp_path)


def test_kit_accepts_an_epsilon_predicting_dit() -> None:
    registry = load_registry()
    epsilon = TrainingObjective(prediction="epsilon", timestep_sampling="uniform")
    flux = registry.family("flux")
    dit = dataclasses.replace(flux, training=dataclasses.replace(flux.training, objective=epsilon))

    class Epsilon:
        from engine.contract.hookspecs import hookimpl

        @hookimpl
        def engine_training_objective(self, family: object) -> TrainingObjective:
            return epsilon

    FamilyContract().test_engine_training_objective(load_registry(plugins=[("eps", Epsilon())]), dit)


def _third_party_families() -> list[str]:
    return sorted(f for p in load_registry().plugins if p.package != "diffusion-engine" for f in p.families)


# The full kit, model run included, for every installed third-party family
# (the worked example under `make install`, as CI installs it).
for _name in _third_party_families():
    _kit = f"TestInstalledKit_{_name}"
    globals()[_kit] = type(_kit, (FamilyContract,), {"family_name": _name})


def test_kit_catches_lora_markers_that_claim_another_familys_lora(tmp_path: Path) -> None:
    """The reported case: a family whose markers are too wide (a generic ``transformer_blocks.``)
    would have another family's LoRA named as its own; the kit fails the family that is misnamed."""
    import numpy as np
    from safetensors.numpy import save_file

    from engine.contract.types import LoraLayout

    registry = load_registry()
    flux = registry.family("flux")
    greedy = dataclasses.replace(registry.family("zimage"), lora=LoraLayout(key_markers=("transformer_blocks",)))
    lora = tmp_path / "flux-lora.safetensors"
    weights = {f"transformer.transformer_blocks.{i}.attn.to_q.lora_A.weight": np.zeros((2, 4), np.float32)
               for i in range(3)}
    save_file(weights, str(lora))
    collided = dataclasses.replace(registry, families={**registry.families, "zimage": greedy})
    with pytest.raises(AssertionError, match="looks like a Z-Image LoRA"):
        FamilyContract().check_lora_markers_tell_it_apart(collided, flux, lora)
    FamilyContract().check_lora_markers_tell_it_apart(registry, flux, lora)  # no collision: passes


def test_a_kit_check_whose_subprocess_fails_shows_that_subprocess_error_output() -> None:
    """The torch-free check runs in a fresh interpreter: when it fails there (here a plugin module
    that does not import), the failure shows the subprocess's traceback, not just its status."""

    class Unimportable(FamilyContract):
        family_name = "sd3"
        plugin_module = "no_such_family_plugin"

    with pytest.raises(AssertionError) as failed:
        Unimportable().test_info_resolves_without_torch()
    message = str(failed.value)
    assert "exited with status 1" in message
    assert "ModuleNotFoundError: No module named 'no_such_family_plugin'" in message
