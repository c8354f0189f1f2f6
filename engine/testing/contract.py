"""The contract every family plugin passes, as a reusable test class.

Like diffusers' tester mixins: subclass it in a test module, set
``family_name`` (and ``plugin_module`` when the family is not installed
through an entry point), and pytest collects every check below for it. Each
check goes through a fresh plugin manager, so it sees what a user's engine
would see.

The checks are about consistency (what the table advertises is what the
engine accepts, what it declares about its classes is what they do), and
one runs the model: the tiny pipeline is loaded through the engine,
generates, trains two LoRA steps, and the saved LoRA reloads and changes the
image (:func:`engine.testing.run.run_model`). A family with no tiny pipeline
fails the kit, with what to add.
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
from engine.errors import PluginError
from engine.contract.plugins import Registry, load_registry
from engine.contract.types import PURPOSES, QUANT_SCHEMES, TRAINING_PRECISIONS, Checkpoint, FamilySpec

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_tiny_or_fail(registry: Registry, family: FamilySpec, path: Path, checkpoint: Checkpoint | None = None) -> Path:
    """The family's (or ``checkpoint``'s) tiny pipeline, or a test failure saying how to
    provide one (never a skip: a family the kit cannot run is not shown to work)."""
    try:
        return registry.build_tiny_pipeline(family, path, checkpoint)
    except PluginError as exc:
        where = "Checkpoint.tiny_pipeline" if checkpoint is not None else "FamilySpec.tiny_pipeline"
        pytest.fail(
            f"{family.name}: {exc.message}; set {where} to a "
            "'module:function' writing a tiny random-weight pipeline (or implement "
            "engine_build_tiny_pipeline) so the kit can run the model"
        )


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
    #: A checkpoint with its own pipeline class (and ``Checkpoint.tiny_pipeline``): the model
    #: checks run on its tiny pipeline (a second subclass per such checkpoint); None: the family's.
    checkpoint_name: ClassVar[str | None] = None

    @pytest.fixture
    def registry(self) -> Registry:
        return fresh_registry(self.plugin_module)

    @pytest.fixture
    def family(self, registry: Registry) -> FamilySpec:
        return registry.family(self.family_name)

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_folder(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The family's tiny pipeline, built once for the class's checks."""
        registry = fresh_registry(cls.plugin_module)
        family = registry.family(cls.family_name)
        checkpoint = family.checkpoint(cls.checkpoint_name) if cls.checkpoint_name else None
        assert checkpoint is not None or not cls.checkpoint_name, f"{family.name} has no checkpoint {cls.checkpoint_name!r}"
        return build_tiny_or_fail(registry, family, tmp_path_factory.mktemp(f"kit-{family.name}") / "tiny", checkpoint)

    # -- the table ------------------------------------------------------------

    def test_engine_register_families(self, registry: Registry) -> None:
        assert self.family_name in registry.families
        assert not [e for e in registry.errors if self.family_name in e.plugin]

    def test_table_is_well_formed(self, family: FamilySpec) -> None:
        from engine.requests.bodies import MAX_INPUT_IMAGES

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
            # Checkpoints may share one repo (a subfolder or revision apart): each is named alone by its reference.
            assert family.checkpoint(checkpoint.reference) == checkpoint, checkpoint.reference
            if checkpoint.sigmas:  # a fixed schedule: one sigma a step, from pure noise down
                assert len(checkpoint.sigmas) == checkpoint.default_steps, (
                    f"{checkpoint.name}: {len(checkpoint.sigmas)} sigmas for {checkpoint.default_steps} default steps")
                assert list(checkpoint.sigmas) == sorted(checkpoint.sigmas, reverse=True), checkpoint.name
            # An edit's images reach it through the request, which takes at most MAX_INPUT_IMAGES.
            assert 1 <= checkpoint.reference_images <= MAX_INPUT_IMAGES, (
                f"{checkpoint.name}: reference_images {checkpoint.reference_images} is outside 1-{MAX_INPUT_IMAGES}, "
                "what a request's image list takes")
            if checkpoint.trained_on:  # a distilled model's LoRAs train on a checkpoint of the table
                target = family.checkpoint(checkpoint.trained_on)
                assert target is not None and target.name == checkpoint.trained_on, (
                    f"{checkpoint.name}: trained_on {checkpoint.trained_on!r} names no checkpoint of {family.name}")
                assert target.trained_on is None, f"{target.name} trains on itself, not on a third checkpoint"
        assert family.training.dense_gb > 0
        assert family.lora.targets
        assert all(reason for _, reason in family.precision.fp16_unsafe), (
            "a family unsafe in fp16 must say why"
        )
        # No runtime module is the field's default (the pipeline encodes its own prompts).
        assert not family.runtime_module or family.runtime_module.split(".")[0].isidentifier()
        self.check_output_kind(family)

    def check_output_kind(self, family: FamilySpec) -> None:
        """A video family says how its clips are shaped, checkpoint by checkpoint."""
        from engine.contract.types import OUTPUT_KINDS

        assert family.rendering.output in OUTPUT_KINDS, f"output {family.rendering.output!r} is not one of {OUTPUT_KINDS}"
        if family.rendering.output == "images":
            assert family.rendering.video is None and all(c.video is None for c in family.checkpoints), (
                "an image family declares no VideoSpec; set output='frames' for a video family"
            )
            return
        for checkpoint in family.checkpoints:
            video = family.video_of(checkpoint)
            assert video is not None, f"{checkpoint.name}: a frames family declares its VideoSpec"
            assert video.in_range(video.default_frames)
            for width, height in video.presets:
                assert width % video.size_multiple == 0 and height % video.size_multiple == 0, (
                    f"{checkpoint.name}: preset {width}x{height} is off its size multiple {video.size_multiple}")
                token = family.geometry_of(checkpoint).token_pixels
                assert width % token == 0 and height % token == 0, (
                    f"{checkpoint.name}: preset {width}x{height} is not whole tokens of {token} px")

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
        from engine.contract.types import OPTIMIZATIONS

        denied = registry.optimization_deny(family)
        assert set(denied) <= set(OPTIMIZATIONS), denied
        assert all(reason.strip() for reason in denied.values())

    def test_engine_dense_base(self, registry: Registry, family: FamilySpec) -> None:
        for checkpoint in family.checkpoints:
            assert registry.dense_base(family, checkpoint.repo) is None
        if family.quantisation.prequantised_patterns:
            name = family.quantisation.prequantised_patterns[0].replace("*", "")
            repo = f"someone/{family.default_checkpoint.repo.split('/')[1]}-{name}"
            assert registry.dense_base(family, repo) == family.default_checkpoint.repo

    def test_engine_training_precision_modes(self, registry: Registry, family: FamilySpec) -> None:
        for hardware in PRESETS.values():
            modes = registry.training_precision_modes(family, hardware)
            assert set(modes) <= set(TRAINING_PRECISIONS)
            assert bool(modes) == family.training.base_precision_applies

    def test_engine_compile_regions(self, registry: Registry, family: FamilySpec) -> None:
        regions = registry.compile_regions(family)
        assert all(_IDENTIFIER.match(r) for r in regions), regions

    def test_engine_training_objective(self, registry: Registry, family: FamilySpec) -> None:
        """Any objective is allowed (DiTs predict epsilon too); it must be one
        the trainer knows, and a trainable family needs its runtime functions."""
        objective = registry.training_objective(family)
        if objective is not None:
            assert objective.prediction in ("flow_matching", "epsilon", "v_prediction")
            assert objective.timestep_sampling in ("logit_normal", "uniform", "shifted_sigmoid")
            assert family.runtime_module, "a trainable family names its runtime_module"

    def test_engine_build_tiny_pipeline(self, registry: Registry, family: FamilySpec, tiny_folder: Path) -> None:
        """The tiny pipeline is a real diffusers folder of this family's class (a modular one's too)."""
        from engine.preflight.pipeline_index import read_index

        folder = tiny_folder
        index = read_index(folder)
        assert index is not None, f"{folder} has no model_index.json (nor a modular_model_index.json)"
        assert index.class_name in family.pipeline_class_names
        if self.checkpoint_name:
            wanted = family.pipeline_class_of(family.checkpoint(self.checkpoint_name))
            assert index.class_name == wanted, f"{self.checkpoint_name}'s tiny pipeline is not a {wanted}"
        assert registry.family_for_pipeline_class(index.class_name) == family
        weights = list(folder.glob("*/*.safetensors"))
        assert weights, "weights are saved as safetensors"
        assert sum(w.stat().st_size for w in weights) < 100e6, "tiny means tiny"

    # -- consistency: what is advertised is what the engine accepts ---------------

    def test_advertised_training_modes_pass_the_preflight(self, registry: Registry, family: FamilySpec) -> None:
        """Every base precision ``info`` advertises on a preset is one the
        training precision preflight accepts there, and a family is called
        trainable only when it has a trainer."""
        from engine.policy.info import training_info
        from engine.policy.training import training_precision_preflight_error

        trainable = registry.training_objective(family) is not None
        for name, hardware in PRESETS.items():
            info = training_info(registry, family, hardware)
            assert not info.trainable or trainable, f"{name}: info calls a family with no trainer trainable"
            for mode in info.precision_modes:
                error = training_precision_preflight_error(registry, family, hardware, mode)
                assert error is None, f"{name}: {mode} is advertised but refused: {error.message}"

    def test_checkpoint_sizes_agree_with_the_family(self, registry: Registry, family: FamilySpec) -> None:
        """A checkpoint's own sizes, where given, are sizes of the same parts,
        and the dense denoiser a trainer holds is the table's transformer."""
        for checkpoint in family.checkpoints:
            sizes = registry.component_sizes(family, checkpoint)
            assert sizes.total_gb == sizes.transformer_gb + sizes.text_encoders_gb + sizes.vae_gb
        assert family.training.dense_gb <= family.sizes.transformer_gb * 1.5, (
            "training_dense_gb is the denoiser's bf16 size; it cannot be far above the transformer's"
        )

    def test_declared_capabilities_hold_on_the_tiny_pipeline(
        self, registry: Registry, family: FamilySpec, tiny_folder: Path
    ) -> None:
        """What the table declares about its classes is what the classes do."""
        from engine.runtime.capabilities import verify
        from engine.runtime.modular import open_pipeline

        # As the engine holds it: processors built as it builds them (an edit model's without
        # torchvision's video part), a modular pipeline behind its runner.
        pipe = open_pipeline(tiny_folder, family)
        wrong = [
            f"{c.name}: declared {c.declared}, the class says {c.verified} ({c.detail})"
            for c in verify(family, pipe, registry.compile_regions(family)).values()
            if c.contradicts
        ]
        assert not wrong, "; ".join(wrong)

    # -- the model runs through the engine -------------------------------------------

    def test_runs_the_model(self, registry: Registry, family: FamilySpec, tiny_folder: Path, tmp_path: Path) -> None:
        """Load the tiny pipeline through the engine, generate, train 2 LoRA
        steps, reload the saved LoRA through the engine: the image changes."""
        from engine.testing.run import run_model

        report = run_model(registry, family, tmp_path, folder=tiny_folder)
        assert report.failure is None, report.failure
        if report.lora is not None:
            self.check_lora_markers_tell_it_apart(registry, family, report.lora)

    def test_memory_figures_size_the_lora_targets(self, family: FamilySpec) -> None:
        """Each fact once: the memory figures' LoRA shapes are of the family's own targets."""
        memory = family.training.memory
        if memory is not None:
            shapes = {shape.target for shape in memory.lora_targets}
            assert shapes <= set(family.lora.targets), (
                f"training.memory sizes LoRA targets {sorted(shapes - set(family.lora.targets))} that "
                "lora.targets does not adapt; derive the figures again for the current targets"
            )

    def test_runtime_module_keeps_the_contract(self, family: FamilySpec) -> None:
        """The runtime module has the functions the trainer calls, taking what it passes
        (``engine.contract.family_runtime.FamilyRuntime``), and optional ones take theirs too."""
        import importlib

        from engine.contract.family_runtime import runtime_problems

        if not family.runtime_module:
            assert family.training.objective is None, "a trainable family names its runtime_module"
            return
        objective = family.training.objective
        problems = runtime_problems(importlib.import_module(family.runtime_module),
                                    flow_matching=objective is None or objective.prediction == "flow_matching")
        assert problems == [], f"{family.runtime_module}: " + "; ".join(problems)

    def check_lora_markers_tell_it_apart(self, registry: Registry, family: FamilySpec, lora: Path) -> None:
        """A LoRA the engine trained for this family is never taken for another installed
        family's (their ``lora.key_markers`` collide): a LoRA that fails to load is then never
        named as something it is not. Matching no family's markers is allowed: the refusal
        then says its keys do not match the model."""
        from engine.preflight.lora import LoraChoice, looks_like, read_lora

        keys = read_lora(LoraChoice(str(lora))).keys
        guess = looks_like(registry, keys)
        assert guess is None or guess.name == family.name, (
            f"a {family.label} LoRA (keys like {', '.join(sorted(keys)[:2])}) looks like a {guess.label} "
            f"LoRA: {guess.name}'s lora.key_markers match its keys. Give this family markers its keys hold "
            f"more of (lora=LoraLayout(key_markers=...)), or tell {guess.name}'s author its markers are too wide"
        )

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
        out = run_python(code)
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"heavy": [], "presets": len(PRESETS)}


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout. A failure is an AssertionError that shows
    what the subprocess wrote to stderr (its traceback: a plugin that fails to import, say), not
    only its exit status."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"the kit's subprocess exited with status {done.returncode}; its stderr:\n"
                             f"{done.stderr.strip()[-4000:] or '(empty)'}")
    return done.stdout
