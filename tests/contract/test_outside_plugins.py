"""Plugins written from the docs by outside authors load unchanged and pass the contract kit.

A PixArt-Sigma plugin of plugin API 0 (flat fields), a Lumina-Image 2.0 plugin and a Sana
plugin of plugin API 1 (sections; Sana's 32x DC-AE in its geometry, its resolution binning
turned off in ``engine_generate_kwargs``): each on a tiny random-weight pipeline of its real
diffusers classes, the kit's model run included (load through the engine, generate). Their old
spellings warn (rows of the register), and are read where plugin API 2 keeps them.
"""

from __future__ import annotations

import pytest

from engine.testing import FamilyContract


@pytest.mark.filterwarnings("ignore::engine.deprecation.PluginDeprecationWarning")  # API 0: its register rows warn
class TestAPixArtPluginOfApi0PassesTheKit(FamilyContract):
    family_name = "pixart-sigma"
    plugin_module = "tests.plugins.pixart_family"


@pytest.mark.filterwarnings("ignore::engine.deprecation.PluginDeprecationWarning")  # API 1: its loose fields warn
class TestALuminaPluginOfApi1PassesTheKit(FamilyContract):
    family_name = "lumina2"
    plugin_module = "tests.plugins.lumina_family"


@pytest.mark.filterwarnings("ignore::engine.deprecation.PluginDeprecationWarning")  # API 1: its loose fields warn
class TestASanaPluginOfApi1PassesTheKit(FamilyContract):
    family_name = "sana"
    plugin_module = "tests.plugins.sana_family"


def test_the_pixart_plugin_is_told_what_its_api_0_fields_are_now() -> None:
    """Its old spellings warn with the register's words, once each, naming the new ones."""
    import importlib
    import sys
    import warnings

    from engine.deprecation import PluginDeprecationWarning

    sys.modules.pop("tests.plugins.pixart_family", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module("tests.plugins.pixart_family")
    said = sorted(str(w.message).split(" is ")[0] for w in caught if issubclass(w.category, PluginDeprecationWarning))
    assert said == ["FamilySpec(compile_regions=...)", "FamilySpec(lora_targets=...)", "FamilySpec(quant_deny={...})",
                    "FamilySpec(training_dense_gb=...)"]


def test_a_sana_plugin_declaring_what_the_engine_derives_is_told_so_once() -> None:
    """Its ``side_multiple=32`` is its geometry's token side (32x DC-AE, 1x1 patches), which the
    engine derives: one warning naming the row, listed under the plugin by ``families``; the
    sides it renders at are the same either way."""
    import importlib
    import warnings

    from engine.contract.plugins import DERIVED, load_registry

    module = importlib.import_module("tests.plugins.sana_family")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = load_registry(plugins=[("sana-plugin", module)], entry_points=False)
    told = [str(w.message) for w in caught if "derives it from rendering.geometry" in str(w.message)]
    assert told == [DERIVED["side_multiple"].message()]
    info = next(p for p in registry.plugins if p.name == "sana-plugin")
    assert told[0] in info.deprecations
    sana = registry.family("sana")
    assert sana.rendering.sides == 32 == sana.rendering.geometry.token_pixels
