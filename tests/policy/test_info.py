"""Info: torch-free, every preset x family, through the API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.hardware.presets import PRESETS
from engine.contract.plugins import load_registry
from engine.policy.info import images_info
from tests.support import run_cli

REGISTRY = load_registry()


def test_resolving_info_for_every_preset_and_family_imports_no_torch() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        from engine.hardware.presets import PRESETS
        from engine.contract.plugins import load_registry
        from engine.policy.info import images_info, training_info
        from engine.policy.training import training_precision_preflight_error
        registry = load_registry()
        count = 0
        for hw in PRESETS.values():
            for family in registry.families.values():
                images_info(registry, family)
                training_info(registry, family, hw)
                for mode in ("nf4", "bf16", "int8", "fp8", "mxfp8", "auto"):
                    training_precision_preflight_error(registry, family, hw, mode)
                count += 1
        print(json.dumps({"torch": "torch" in sys.modules, "count": count}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"torch": False, "count": len(PRESETS) * len(REGISTRY.families)}


@pytest.mark.parametrize("family", sorted(REGISTRY.families))
def test_images_info_estimates_resident_bytes_per_scheme(family: str) -> None:
    spec = REGISTRY.family(family)
    info = images_info(REGISTRY, spec)
    sizes = info.sizes_gb
    others = sizes.text_encoders_gb + sizes.vae_gb
    factor = {"int8": 0.55, "nvfp4": 0.33, **dict(spec.quantisation.factors)}  # the family's own, else generic
    assert info.resident_gb["bf16"] == pytest.approx(sizes.transformer_gb + others, abs=0.01)
    assert info.resident_gb["int8"] == pytest.approx(factor["int8"] * sizes.transformer_gb + others, abs=0.01)
    assert info.resident_gb["nvfp4"] == pytest.approx(factor["nvfp4"] * sizes.transformer_gb + others, abs=0.01)
    assert info.resident_gb["nf4"] < info.resident_gb["int8"] < info.resident_gb["bf16"]


def test_images_info_figures_match_the_published_sizes() -> None:
    totals = {
        name: images_info(REGISTRY, REGISTRY.family(name)).resident_gb["bf16"]
        for name in ("flux", "qwen_image", "zimage", "sdxl")  # an installed plugin's family has its own
    }
    assert totals == {"flux": 33.8, "qwen_image": 57.8, "zimage": 20.5, "sdxl": 6.9}


def test_cli_info_t4_refuses_dit_training_with_the_reason() -> None:
    result = run_cli("info", "--hardware", "t4", "--json")
    assert result.returncode == 0, result.stderr
    families = json.loads(result.stdout)["families"]
    for name in ("flux", "qwen_image", "zimage"):
        training = families[name]["training"]
        assert training["precision_modes"] == [] and "native bf16" in training["vram_note"]
    assert families["sdxl"]["training"]["trainable"] is True


def test_cli_info_h100_qwen_image_modes_exclude_fp8() -> None:
    result = run_cli("info", "--hardware", "h100", "--family", "qwen-image", "--json")
    payload = json.loads(result.stdout)["families"]["qwen_image"]
    assert payload["training"]["precision_modes"] == ["nf4", "bf16", "int8", "auto"]
    assert set(payload["images"]["denied"]) == {"fp8", "mxfp8", "nvfp4"}


def test_cli_machine_overrides_change_the_answer() -> None:
    # 25 GB: the bf16 base (23.8 GB) plus a checkpointed step does not fit; int8 does.
    tight = json.loads(run_cli("info", "--hardware", "h100", "--free-gb", "25", "--json").stdout)
    assert tight["hardware"]["free_memory_gb"] == 25
    assert tight["families"]["flux"]["training"]["recommended_precision"] == "int8"
    no_ao = json.loads(
        run_cli("info", "--hardware", "h100", "--free-gb", "25", "--no-torchao", "--json").stdout
    )
    flux = no_ao["families"]["flux"]["training"]
    assert "int8" not in flux["precision_modes"] and flux["recommended_precision"] == "nf4"


@pytest.mark.parametrize(
    ("args", "code", "listed"),
    [
        (("info", "--hardware", "rtx9090"), "unknown_preset", "rtx4090"),
        (("info", "--family", "sd15"), "unknown_family", "qwen_image"),
    ],
)
def test_cli_unknown_names_exit_2_listing_valid_names(args: tuple[str, ...], code: str, listed: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert f"error[{code}]" in result.stderr and listed in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_info_text_shows_every_family() -> None:
    result = run_cli("info", "--hardware", "rtx4090")
    assert result.returncode == 0
    for label in ("FLUX.1", "Qwen-Image", "Z-Image", "Stable Diffusion XL"):
        assert label in result.stdout


def test_example_family_appears_in_info(install_example: Callable[[], Path]) -> None:
    install_example()
    result = run_cli("info", "--hardware", "h100", "--json")
    families = json.loads(result.stdout)["families"]
    assert families["sd3"]["images"]["sizes_gb"]["transformer"] == 4.9
    assert "auto" in families["sd3"]["training"]["precision_modes"]


def test_info_on_this_machine_works_without_flags() -> None:
    result = run_cli("info", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["hardware"]["source"].startswith("probe")


def test_families_all_lists_the_builtin_table_plugin_and_its_hooks() -> None:
    result = run_cli("families", "--all", "--json")
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    table = plugins["engine.table_plugin"]
    assert table["builtin"] and "engine_component_sizes" in table["hooks"]
    assert "engine.table_plugin" not in {p["name"] for p in json.loads(run_cli("families", "--json").stdout)["plugins"]}


@pytest.mark.slow
def test_doctor_probes_this_machine_with_torch() -> None:
    result = run_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    profile = json.loads(result.stdout)["hardware"]
    assert profile["source"] == "probe+torch"
    assert isinstance(profile["torchao_functional"], bool)
