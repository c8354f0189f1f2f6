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
