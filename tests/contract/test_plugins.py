"""Plugin loading: entry points one by one, broken plugins reported, conflicts named."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pluggy
import pytest

from engine.contract import hookspecs
from engine.errors import FamilyConflict, PluginError
from engine.contract.hookspecs import hookimpl
from engine.contract.plugins import BLOCK_ENV, STRICT_ENV, load_registry
from engine.contract.types import FamilySpec
from families.flux.table import FLUX
from tests.support import example_installed, run_cli, write_distribution

BUILTINS = {"flux", "flux2", "qwen_image", "zimage", "sdxl", "wan", "hunyuan_video", "ltx2", "minimax_h3", "krea2", "lumina2", "qwen_image21", "ideogram4", "hidream", "hunyuan_image", "flux3"}
#: The families every registry here has: the built-ins, and the worked example
#: where it is installed (``make install`` installs it, as CI does).
INSTALLED = BUILTINS | ({"sd3"} if example_installed() else set())

BROKEN_PLUGIN = """
raise RuntimeError("this plugin is broken on purpose")
"""

SECOND_FLUX = """
import dataclasses
from engine.contract.hookspecs import hookimpl
from families.flux.table import FLUX

@hookimpl
def engine_register_families(register):
    register(dataclasses.replace(FLUX, aliases=()))
"""


def test_builtin_families_come_from_their_entry_points() -> None:
    registry = load_registry()
    assert set(registry.families) == INSTALLED
    for name in BUILTINS:
        owner = next(p for p in registry.plugins if name in p.families)
        assert owner.package == "diffusion-engine"
        assert owner.name == name
        assert "engine_register_families" in owner.hooks
    assert registry.errors == ()


def test_example_third_party_family_is_listed_and_sized(
    install_example: Callable[[], Path],
) -> None:
    install_example()
    registry = load_registry()
    assert set(registry.families) == BUILTINS | {"sd3"}
    sd3 = registry.family("sd3.5")
    owner = next(p for p in registry.plugins if "sd3" in p.families)
    assert (owner.package, owner.version) == ("diffusion-engine-sd3", "0.1.0")
    assert registry.component_sizes(sd3).transformer_gb == 4.9
    # Its collected deny hook extends another plugin's family, too.
    assert "nvfp4" in registry.quant_deny(registry.family("sdxl"), "inference")
    assert "nvfp4" not in registry.quant_deny(registry.family("flux"), "inference")


def test_cli_families_json_lists_builtins_example_and_broken_plugin(
    install_example: Callable[[], Path], site: Path
) -> None:
    install_example()
    write_distribution(site, "broken-family", {"broken": "broken_family"}, {"broken_family": BROKEN_PLUGIN})
    result = run_cli("families", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    names = {f["name"] for f in payload["families"]}
    assert names == BUILTINS | {"sd3"}
    sd3 = next(f for f in payload["families"] if f["name"] == "sd3")
    assert sd3["package"] == "diffusion-engine-sd3"
    [error] = payload["errors"]
    assert error["plugin"] == "broken" and error["package"] == "broken-family"
    assert "broken on purpose" in error["error"]


def test_broken_plugin_is_fatal_in_strict_mode(site: Path) -> None:
    write_distribution(site, "broken-family", {"broken": "broken_family"}, {"broken_family": BROKEN_PLUGIN})
    with pytest.raises(PluginError, match="broken on purpose") as raised:
        load_registry(env={STRICT_ENV: "1"})
    assert raised.value.code == "plugin_load_failed"
    result = run_cli("families", env={STRICT_ENV: "1"})
    assert result.returncode == 2
    assert "error[plugin_load_failed]" in result.stderr and "Traceback" not in result.stderr


def test_block_list_skips_entry_points_by_name_or_package(site: Path) -> None:
    write_distribution(site, "broken-family", {"broken": "broken_family"}, {"broken_family": BROKEN_PLUGIN})
    registry = load_registry(env={BLOCK_ENV: "broken-family, sdxl, diffusion-engine-sd3"})
    assert set(registry.families) == BUILTINS - {"sdxl"}
    assert registry.errors == ()


def test_two_installed_plugins_claiming_one_family_name_both_packages(site: Path) -> None:
    write_distribution(site, "flux-again", {"flux_again": "flux_again"}, {"flux_again": SECOND_FLUX})
    write_distribution(site, "flux-thrice", {"flux_thrice": "flux_thrice"}, {"flux_thrice": SECOND_FLUX})
    with pytest.raises(FamilyConflict) as raised:
        load_registry()
    message = raised.value.message
    assert "'flux'" in message and "flux-again" in message and "flux-thrice" in message


def test_an_installed_plugin_serving_a_built_in_familys_name_is_used_with_a_warning(site: Path) -> None:
    """Installed on purpose: its family serves in place of the engine's (blocking it brings the built-in back)."""
    from engine.contract.plugins import FamilyShadowed

    write_distribution(site, "flux-again", {"flux_again": "flux_again"}, {"flux_again": SECOND_FLUX})
    with pytest.warns(FamilyShadowed, match="'flux'.*flux_again.*flux-again"):
        registry = load_registry()
    assert registry.family("flux").aliases == () and registry.errors == ()
    assert load_registry(env={BLOCK_ENV: "flux-again"}).family("flux").aliases  # the built-in again


def test_alias_collision_is_a_conflict_too() -> None:
    class Squatter:
        @hookimpl
        def engine_register_families(self, register: Callable[[FamilySpec], None]) -> None:
            import dataclasses

            register(dataclasses.replace(FLUX, name="not_flux", aliases=("flux1",)))

    with pytest.raises(FamilyConflict, match="flux1"):
        load_registry(plugins=[("squatter", Squatter())])


def test_hookimpl_with_no_spec_is_reported_by_check_pending() -> None:
    class Typo:
        @hookimpl
        def engine_compnent_sizes(self, family: FamilySpec) -> None:  # misspelt on purpose
            return None

    registry = load_registry(plugins=[("typo", Typo())])
    [error] = registry.errors
    assert error.plugin == "typo" and "engine_compnent_sizes" in error.error
    assert set(registry.families) == INSTALLED


def test_plugin_whose_register_raises_is_reported_not_fatal() -> None:
    class Faulty:
        @hookimpl
        def engine_register_families(self, register: Callable[[FamilySpec], None]) -> None:
            register("not a spec")  # type: ignore[arg-type]

    registry = load_registry(plugins=[("faulty", Faulty())])
    [error] = registry.errors
    assert error.plugin == "faulty" and "not a FamilySpec" in error.error
    assert set(registry.families) == INSTALLED


def test_a_plugin_overrides_a_family_table_answer() -> None:
    class Overrider:
        @hookimpl
        def engine_compile_regions(self, family: FamilySpec) -> tuple[str, ...] | None:
            return ("MyFasterBlock",) if family.name == "flux" else None

    registry = load_registry(plugins=[("overrider", Overrider())])
    assert registry.compile_regions(registry.family("flux")) == ("MyFasterBlock",)
    assert registry.compile_regions(registry.family("sdxl")) == ("BasicTransformerBlock",)


def test_optimization_denies_from_several_plugins_are_unioned() -> None:
    from engine.contract.types import OptimizationDeny

    class NoSage:
        @hookimpl
        def engine_optimization_deny(self, family: FamilySpec) -> tuple[OptimizationDeny, ...]:
            return (OptimizationDeny("sage", "black frames in our A/B"),)

    registry = load_registry(plugins=[("no_sage", NoSage())])
    zimage = registry.optimization_deny(registry.family("zimage"))
    assert set(zimage) == {"sage", "step_cache"}
    assert registry.optimization_deny(registry.family("flux")) == {"sage": "black frames in our A/B"}


def test_registry_is_immutable() -> None:
    registry = load_registry()
    with pytest.raises(TypeError):
        registry.families["x"] = FLUX  # type: ignore[index]
    with pytest.raises(AttributeError):
        registry.errors = ()  # type: ignore[misc]


def test_loading_twice_gives_independent_equal_registries() -> None:
    first, second = load_registry(), load_registry()
    assert first.families == second.families and first is not second


def test_hookspecs_have_no_default_arguments() -> None:
    """pluggy silently drops spec defaults; an implementation asking for one would fail."""
    for name in hook_names():
        parameters = inspect.signature(getattr(hookspecs, name)).parameters.values()
        assert all(p.default is inspect.Parameter.empty for p in parameters), name


def test_unknown_family_lists_valid_names() -> None:
    from engine.errors import UnknownName

    with pytest.raises(UnknownName) as raised:
        load_registry().family("stable-cascade")
    assert raised.value.code == "unknown_family"
    assert ", ".join(sorted(INSTALLED)) in raised.value.message


def hook_names() -> list[str]:
    return [n for n, f in vars(hookspecs).items() if n.startswith("engine_") and callable(f)]


def test_every_hook_is_a_firstresult_or_collected_hook_as_documented() -> None:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    collected = {"engine_register_families", "engine_quant_deny", "engine_optimization_deny"}
    for name in hook_names():
        opts = getattr(pm.hook, name).spec.opts
        assert opts["firstresult"] is (name not in collected), name


def test_every_field_of_the_plugin_data_classes_has_a_doc_line() -> None:
    """docs/plugins.md's field reference has a line, with text, for every field of
    FamilySpec, Checkpoint, ComponentSizes, TrainingObjective and Capabilities."""
    import dataclasses

    from engine.testing.fieldref import CLASSES, END, START, field_docs

    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    reference = docs[docs.index(START): docs.index(END)]
    sections = {part.split("`", 1)[0]: part for part in reference.split("#### `")[1:]}
    missing = [
        f"{cls.__name__}.{field.name}"
        for cls in CLASSES
        for field in dataclasses.fields(cls)
        if not field_docs(cls)[field.name] or f"- `{field.name}`:" not in sections.get(cls.__name__, "")
    ]
    assert not missing, (
        f"no doc line for {', '.join(missing)}: give each a #: comment in engine/contract/types.py, "
        "then run python -m engine.testing.fieldref --write"
    )


@pytest.mark.filterwarnings("ignore::engine.deprecation.PluginDeprecationWarning")  # API 1: its loose fields warn
def test_an_installed_plugin_keeps_serving_a_family_the_engine_now_builds_in() -> None:
    """A Lumina 2 plugin written before the engine had one: its family is used, with a warning
    that names both and how to get the built-in back; the built-in serves when nothing claims it."""
    import importlib

    from engine.contract.plugins import FamilyShadowed

    outside = importlib.import_module("tests.plugins.lumina_family")
    with pytest.warns(FamilyShadowed, match="'lumina2'.*in place of the engine's built-in") as said:
        registry = load_registry(plugins=[("outside-lumina", outside)])
    assert registry.family("lumina2") is outside.LUMINA2
    assert "DIFFUSION_ENGINE_BLOCK_PLUGINS=outside-lumina" in str(said[0].message)
    assert not [e for e in registry.errors if "lumina" in e.plugin]
    assert load_registry().family("lumina2").label == "Lumina 2"  # the built-in, unclaimed
