"""Plugin API 1: a family written for the first release still loads (with warnings naming the
new spellings) and passes the contract kit; a plugin the engine cannot read says which API it
needs and which it got."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION, PluginDeprecationWarning
from engine.contract.plugins import BLOCK_ENV, load_registry
from engine.testing import FamilyContract
from engine.contract.types import FamilySpec, LoraLayout, TrainingObjective, TrainingSpec
from families.flux.table import FLUX
from tests.support import write_distribution

OLD_PLUGIN = "tests.plugins.api0_family"
#: The installed worked example claims the same family: it steps aside for these tests.
WITHOUT_EXAMPLE = {BLOCK_ENV: "diffusion-engine-sd3"}


def test_a_family_written_for_plugin_api_0_loads_with_deprecation_warnings_only(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed as its author shipped it (an entry point), loaded as any plugin is."""
    write_distribution(site, "old-sd3-plugin", {"api0": OLD_PLUGIN})
    monkeypatch.delitem(sys.modules, OLD_PLUGIN, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = load_registry(env=WITHOUT_EXAMPLE)
        spec = registry.family("sd3")
        denied = registry.quant_deny(spec, "training")
    assert [e for e in registry.errors if e.plugin == "api0"] == []
    assert {w.category for w in caught if "plugin API" in str(w.message)} == {PluginDeprecationWarning}
    assert [str(w.message) for w in caught if not issubclass(w.category, PluginDeprecationWarning)] == []
    messages = " | ".join(str(w.message) for w in caught)
    for new in ("FamilySpec(lora=LoraLayout(targets=...))", "FamilySpec(training=TrainingSpec(dense_gb=...))",
                "FamilySpec(runtime_module=...)", "quantisation=QuantRules(deny_inference=..., deny_training=...)",
                "FamilySpec.quantisation.deny(purpose)", "docs/plugins.md#migration"):
        assert new in messages, new
    # Each old value landed where plugin API 1 keeps it.
    assert spec.lora.targets == ("to_q", "to_k", "to_v", "to_out.0")
    assert spec.training.dense_gb == 4.9 and spec.training.requires_bf16
    assert spec.runtime_module == "diffusion_engine_sd3.runtime"
    assert [d.scheme for d in spec.quantisation.deny_training] == ["fp8"] and "fp8" in denied
    assert spec.precision.fp16_safe()
    info = next(p for p in registry.plugins if p.name == "api0")
    assert info.package == "old-sd3-plugin" and info.api is None
    assert any("lora_targets" in line for line in info.deprecations), info.deprecations


@pytest.fixture(scope="class")
def _example_steps_aside() -> Iterator[None]:
    saved = os.environ.get(BLOCK_ENV)
    os.environ[BLOCK_ENV] = WITHOUT_EXAMPLE[BLOCK_ENV]
    yield
    if saved is None:
        del os.environ[BLOCK_ENV]
    else:
        os.environ[BLOCK_ENV] = saved


@pytest.mark.usefixtures("_example_steps_aside")
@pytest.mark.filterwarnings("ignore::engine.contract.plugin_api.PluginDeprecationWarning")
class TestAPlugin0FamilyPassesTheKit(FamilyContract):
    """The whole contract kit (the model run included) on the plugin API 0 family."""

    family_name = "sd3"
    plugin_module = OLD_PLUGIN


def test_the_old_names_read_the_new_fields_with_a_warning() -> None:
    with pytest.warns(PluginDeprecationWarning, match=r"FamilySpec\.lora\.targets"):
        assert FLUX.lora_targets == FLUX.lora.targets  # type: ignore[attr-defined]
    with pytest.warns(PluginDeprecationWarning, match=r"FamilySpec\.precision\.fp16_safe"):
        assert FLUX.fp16_compute_safe is True  # type: ignore[attr-defined]
    with pytest.warns(PluginDeprecationWarning):
        replaced = dataclasses.replace(FLUX, lora_targets=("to_q",))
    assert replaced.lora == LoraLayout(targets=("to_q",), key_markers=FLUX.lora.key_markers,
                                       kohya_map=FLUX.lora.kohya_map)
    with pytest.raises(AttributeError):
        FLUX.no_such_field  # type: ignore[attr-defined]  # noqa: B018
    # An API 0 plugin reads back the runtime module it gave its objective: the value, and the new name.
    with pytest.warns(PluginDeprecationWarning, match=r"TrainingObjective\(runtime_module"):
        old = TrainingObjective("flow_matching", "uniform", runtime_module="my_family.runtime")
    with pytest.warns(PluginDeprecationWarning, match=r"FamilySpec\.runtime_module"):
        assert old.runtime_module == "my_family.runtime"
    with pytest.warns(PluginDeprecationWarning):
        assert TrainingObjective("flow_matching", "uniform").runtime_module is None


def test_a_shape_no_shim_covers_fails_with_the_api_version_message() -> None:
    class Future:
        @hookimpl
        def engine_register_families(self, register: object) -> None:
            register(FamilySpec(  # type: ignore[operator]
                "odd", "Odd", "dit", "OddPipeline", ("OddPipeline",), FLUX.checkpoints, FLUX.sizes,
                warp_drive=True,
            ))

    registry = load_registry(plugins=[("future", Future())])
    [error] = [e for e in registry.errors if e.plugin == "future"]
    assert f"provides plugin API {PLUGIN_API_VERSION}" in error.error and "cannot read it" in error.error
    assert "warp_drive" in error.error and "docs/plugins.md#migration" in error.error
    assert "odd" not in registry.families


def test_a_plugin_for_a_newer_api_says_which_it_needs() -> None:
    class Newer:
        ENGINE_PLUGIN_API = PLUGIN_API_VERSION + 1

        @hookimpl
        def engine_register_families(self, register: object) -> None:
            raise AssertionError("a plugin for a newer API is not asked")

    registry = load_registry(plugins=[("newer", Newer())])
    [error] = [e for e in registry.errors if e.plugin == "newer"]
    assert f"targets plugin API {PLUGIN_API_VERSION + 1}" in error.error
    assert f"provides plugin API {PLUGIN_API_VERSION}: upgrade diffusion-engine" in error.error


def test_the_built_in_families_and_the_example_speak_the_current_api() -> None:
    """Loaded with the deprecation an error (as in this suite), and each declares its API."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginDeprecationWarning)
        registry = load_registry()
    for info in registry.plugins:
        if not info.builtin:
            assert info.api == PLUGIN_API_VERSION and info.deprecations == (), info.name


def test_the_guides_worked_example_as_printed_loads_with_no_deprecation_warning() -> None:
    """docs/plugins.md's worked example, taken from the guide's text and run as a plugin module:
    it loads, declares the current API, and warns about nothing (each old spelling it once
    used would warn here)."""
    import re
    import types as pytypes
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    example = docs[docs.index("## A worked example"):docs.index("## Testing your family")]
    [code] = [block for block in re.findall(r"```python\n(.*?)```", example, re.S) if "FamilySpec(" in block]
    module = pytypes.ModuleType("guide_sd3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)  # noqa: S102 - the guide's own text
        registry = load_registry(plugins=[("guide_sd3", module)], entry_points=False)
        spec = registry.family("sd3")
        denied = registry.quant_deny(spec, "inference")
    assert [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))] == []
    assert not registry.errors
    info = next(p for p in registry.plugins if p.name == "guide_sd3")
    assert info.api == PLUGIN_API_VERSION and info.deprecations == ()
    assert spec.lora.targets == ("to_q", "to_k", "to_v", "to_out.0") and spec.training.dense_gb == 4.9
    assert spec.training.requires_bf16 and spec.precision.fp16_safe() and "nvfp4" in denied


def test_sections_hash_and_compare() -> None:
    """Frozen, hashable sections: a spec is a value (no hand-written __hash__)."""
    assert hash(FLUX) == hash(dataclasses.replace(FLUX))
    assert dataclasses.replace(FLUX, training=TrainingSpec()) != FLUX
    assert "__hash__" not in FamilySpec.__dict__ or FamilySpec.__hash__ is not object.__hash__


def test_the_migration_section_lists_every_move() -> None:
    from pathlib import Path

    from engine.contract.plugin_api import RENAMED, SPLIT

    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Migration"):docs.index("## Loading rules")]
    for old, move in RENAMED.items():
        assert f"`FamilySpec({old}=...)`" in section and f"({move.field}=...)" in section, old
    for old in SPLIT:
        assert old in section, old
    assert "runtime_module=M" in section


def test_a_runtime_module_that_breaks_the_contract_is_named_before_a_run() -> None:
    """The runtime module's functions are a declared contract: a missing one, or one that does
    not take what the trainer passes, is one clear error; a missing module fails at load."""
    import types as pytypes

    from engine.errors import PluginError
    from engine.contract.family_runtime import FamilyRuntime, load_runtime, runtime_problems

    broken = pytypes.ModuleType("broken_runtime")
    broken.encode_prompts = lambda pipe, prompts: {}  # type: ignore[attr-defined]  # no device, dtype
    broken.predict = lambda pipe, denoiser, noisy_latents, timesteps, conditioning: None  # type: ignore[attr-defined]
    broken.prompt_inputs = lambda pipe, kwargs: None  # type: ignore[attr-defined]
    problems = runtime_problems(broken)
    assert any("encode_prompts does not take (pipe, prompts, device, dtype)" in p for p in problems)
    assert any("no encode_images(pipe, pixels)" in p for p in problems)
    assert any("prompt_inputs but not encode_prompt_inputs" in p for p in problems)
    assert any("no training_scheduler(pipe)" in p for p in runtime_problems(broken, flow_matching=False))
    sys.modules["broken_runtime"] = broken
    try:
        spec = dataclasses.replace(FLUX, runtime_module="broken_runtime")
        with pytest.raises(PluginError, match="breaks the FamilyRuntime contract"):
            load_runtime(spec)
    finally:
        del sys.modules["broken_runtime"]
    assert isinstance(importlib.import_module("families.flux.runtime"), FamilyRuntime)

    class Missing:
        @hookimpl
        def engine_register_families(self, register: object) -> None:
            register(dataclasses.replace(FLUX, name="ghost", aliases=(), runtime_module="no_such_pkg.runtime"))  # type: ignore[operator]

    registry = load_registry(plugins=[("ghost", Missing())])
    assert "ghost" not in registry.families
    assert any("not an importable module" in e.error for e in registry.errors if e.plugin == "ghost")


def test_fp16_safety_is_stated_per_component() -> None:
    """A family whose text encoder alone is fp16-unsafe: its denoiser still computes in fp16
    (asked, or on a card without bf16), the encoder beside it in its own dtype, named with
    the reason (tests/policy/test_component_precision.py plans and runs it)."""
    from engine.errors import PreflightError
    from engine.hardware.presets import preset
    from engine.policy.dtype import resolve_dtype
    from engine.contract.types import PrecisionRules

    encoder_only = dataclasses.replace(FLUX, precision=PrecisionRules(
        fp16_unsafe=(("text_encoders", "its T5 overflows to inf in fp16"),)))
    assert encoder_only.precision.fp16_safe("denoiser") and not encoder_only.precision.fp16_safe("text_encoders")
    asked = resolve_dtype(encoder_only, preset("t4"), "fp16", fp32_fits=True)
    assert asked.value == "fp16" and "its text encoders in fp32 (its T5 overflows to inf in fp16)" in asked.reason
    chosen = resolve_dtype(encoder_only, preset("t4"), "auto", fp32_fits=True)
    assert chosen.value == "fp16" and "its text encoders in fp32" in chosen.reason
    denoiser = dataclasses.replace(FLUX, precision=PrecisionRules(fp16_unsafe=(("denoiser", "it renders black"),)))
    with pytest.raises(PreflightError, match="it renders black") as refused:
        resolve_dtype(denoiser, preset("t4"), "fp16", fp32_fits=True)
    assert refused.value.code == "fp16_unsafe"
    assert resolve_dtype(FLUX, preset("t4"), "auto", fp32_fits=True).value == "fp16"
    with pytest.raises(ValueError, match="components are"):
        PrecisionRules(fp16_unsafe=(("unet", "x"),))


def test_the_worked_example_plugin_imports_only_the_contract() -> None:
    """The example a plugin author copies (examples/diffusion-engine-sd3) spells the contract as
    docs/plugins.md teaches: ``engine.contract.*``, never plugin API 1's silent aliases
    (``engine.types``, ``engine.hookspecs``) nor the engine's insides."""
    import ast

    package = Path(__file__).resolve().parents[2] / "examples" / "diffusion-engine-sd3" / "diffusion_engine_sd3"
    outside = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [f"{path.name}:{node.lineno} {name}" for name in names
                        if name.split(".")[0] == "engine" and not name.startswith("engine.contract")]
    assert outside == []
