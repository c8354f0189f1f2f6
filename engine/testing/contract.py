"""The contract every family plugin passes, as a reusable test class.

Like diffusers' tester mixins: subclass it in a test module, set
``family_name`` (and ``plugin_module`` when the family is not installed
through an entry point), and pytest collects every check below for it. Each
check goes through a fresh plugin manager, so it sees what a user's engine
would see.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest

from engine.hardware.presets import PRESETS
from engine.plugins import Registry, load_registry
from engine.types import PURPOSES, QUANT_SCHEMES, TRAINING_PRECISIONS, FamilySpec

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def fresh_registry(plugin_module: str | None = None) -> Registry:
    """A registry from the installed entry points, plus ``plugin_module`` if given."""
    extra: list[tuple[str, object]] = []
    if plugin_module:
        import importlib

        extra.append((plugin_module, importlib.import_module(plugin_module)))
    return load_registry(plugins=extra)


class FamilyContract:
    """Checks a family's table and hooks. Set ``family_name``."""

    family_name: ClassVar[str]
    #: Dotted module of a plugin to register directly (not via entry point).
    plugin_module: ClassVar[str | None] = None

    @pytest.fixture
    def registry(self) -> Registry:
        return fresh_registry(self.plugin_module)

    @pytest.fixture
    def family(self, registry: Registry) -> FamilySpec:
        return registry.family(self.family_name)

    # -- the table ------------------------------------------------------------

    def test_engine_register_families(self, registry: Registry) -> None:
        assert self.family_name in registry.families
        assert not [e for e in registry.errors if self.family_name in e.plugin]

    def test_table_is_well_formed(self, family: FamilySpec) -> None:
        assert family.name == self.family_name
        assert family.label and family.pipeline_class
        assert family.pipeline_class in family.pipeline_class_names
        assert family.architecture in ("dit", "unet")
        assert family.checkpoints, "a family needs at least one checkpoint"
        names = [c.name for c in family.checkpoints]
        assert len(names) == len(set(names)), f"duplicate checkpoint names: {names}"
        for checkpoint in family.checkpoints:
            assert checkpoint.repo.count("/") == 1, checkpoint.repo
            assert checkpoint.default_steps >= 1
            assert checkpoint.default_guidance >= 0
            assert family.checkpoint(checkpoint.repo) == checkpoint
        assert family.training_dense_gb > 0
        assert family.lora_targets
        assert family.fp16_compute_safe or family.fp16_unsafe_reason, (
            "a family unsafe in fp16 must say why"
        )
        assert family.runtime_module.split(".")[0].isidentifier()

    def test_checkpoint_patterns_match_repo_ids(self, family: FamilySpec) -> None:
        for checkpoint in family.checkpoints:
            for pattern in checkpoint.matches:
                sample = pattern.strip("*")
                assert family.checkpoint(f"someone/{sample}") is not None

    # -- every hook, answered through a fresh plugin manager -----------------------

    def test_engine_component_sizes(self, registry: Registry, family: FamilySpec) -> None:
        for checkpoint in (None, *family.checkpoints):
            sizes = registry.component_sizes(family, checkpoint)
            assert sizes.transformer_gb > 0 and sizes.text_encoders_gb >= 0 and sizes.vae_gb > 0

    def test_engine_quant_deny(self, registry: Registry, family: FamilySpec) -> None:
        for purpose in PURPOSES:
            denied = registry.quant_deny(family, purpose)
            assert set(denied) <= set(QUANT_SCHEMES), denied
            assert all(reason.strip() for reason in denied.values()), "every deny needs a reason"
            assert "bf16" not in denied, "the dense reference cannot be denied"

    def test_engine_optimization_deny(self, registry: Registry, family: FamilySpec) -> None:
        known = {"fp16_accumulation", "step_cache", "compile", "sage", "flash", "flash3", "xformers"}
        denied = registry.optimization_deny(family)
        assert set(denied) <= known, denied
        assert all(reason.strip() for reason in denied.values())

    def test_engine_dense_base(self, registry: Registry, family: FamilySpec) -> None:
        for checkpoint in family.checkpoints:
            assert registry.dense_base(family, checkpoint.repo) is None
        if family.prequantised_patterns:
            name = family.prequantised_patterns[0].replace("*", "")
            repo = f"someone/{family.default_checkpoint.repo.split('/')[1]}-{name}"
            assert registry.dense_base(family, repo) == family.default_checkpoint.repo

    def test_engine_training_precision_modes(self, registry: Registry, family: FamilySpec) -> None:
        for hardware in PRESETS.values():
            modes = registry.training_precision_modes(family, hardware)
            assert set(modes) <= set(TRAINING_PRECISIONS)
            assert bool(modes) == family.base_precision_applies

    def test_engine_compile_regions(self, registry: Registry, family: FamilySpec) -> None:
        regions = registry.compile_regions(family)
        assert all(_IDENTIFIER.match(r) for r in regions), regions

    def test_engine_training_objective(self, registry: Registry, family: FamilySpec) -> None:
        objective = registry.training_objective(family)
        if objective is not None:
            expected = {"dit": "flow_matching"}.get(family.architecture)
            assert expected is None or objective.prediction == expected
            assert objective.runtime_module.split(".")[0].isidentifier()

    def test_engine_build_tiny_pipeline(
        self, registry: Registry, family: FamilySpec, tmp_path: Path
    ) -> None:
        """The tiny pipeline is a real diffusers folder of this family's class."""
        if not family.tiny_pipeline:
            pytest.skip(f"{family.name} ships no tiny pipeline")
        folder = registry.build_tiny_pipeline(family, tmp_path / "tiny")
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
        assert index["_class_name"] in family.pipeline_class_names
        assert registry.family_for_pipeline_class(index["_class_name"]) == family
        weights = list(folder.glob("*/*.safetensors"))
        assert weights, "weights are saved as safetensors"
        assert sum(w.stat().st_size for w in weights) < 100e6, "tiny means tiny"

    # -- the policy path stays light -----------------------------------------

    def test_info_resolves_without_torch(self) -> None:
        """Load the plugins and resolve info for every preset in a clean
        interpreter; torch must never be imported on that path."""
        code = textwrap.dedent(
            f"""
            import json, sys
            from engine.hardware.presets import PRESETS
            from engine.policy.info import images_info, training_info
            from engine.testing.contract import fresh_registry
            registry = fresh_registry({self.plugin_module!r})
            family = registry.family({self.family_name!r})
            images_info(registry, family)
            modes = {{n: training_info(registry, family, hw).precision_modes for n, hw in PRESETS.items()}}
            heavy = sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules)
            print(json.dumps({{"heavy": heavy, "presets": len(modes)}}))
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"heavy": [], "presets": len(PRESETS)}
