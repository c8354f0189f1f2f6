"""The hidream plugin: the contract kit, an image through the CLI equal to plain
``HiDreamImagePipeline`` at the size asked, its repos' missing Llama encoder taken from the
family's named repo (in the hub cache) or refused before anything is evicted, and plans on the
cards people use."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.contract.plugins import Registry
from engine.testing import FamilyContract
from families.hidream.table import LLAMA_REPO


class TestHiDreamKit(FamilyContract):
    family_name = "hidream"


@pytest.fixture(scope="module")
def folder(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("hidream")


def _plain(folder: Path, **components: object) -> object:
    from diffusers import HiDreamImagePipeline

    from engine.testing.stock import planned_dtypes

    pipe = HiDreamImagePipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder), **components)
    pipe.default_sample_size = (math.sqrt(64 * 64) + 1e-6) / pipe.vae_scale_factor
    return pipe


def _generator(seed: int) -> object:
    import torch

    return torch.Generator("cpu").manual_seed(seed)


@pytest.mark.parametrize(("card", "memory"), [
    ("rtx4090", "group_offload"),  # 34.2 GB of transformer: even int8 overflows 24 GB
    ("l40s", "model_offload"),     # the dense transformer alone fits and stays for every step
    ("h100", "resident"),
    ("b200", "resident"),
])
def test_hidream_plans_on_the_cards_people_use(card: str, memory: str) -> None:
    """bf16 and the four encoders in fp8 (28.8 GB -> 15.8 GB: run once per prompt) everywhere."""
    from tests.support import table_plan

    plan = table_plan("hidream", card)
    assert (plan.value("dtype"), plan.value("memory_mode")) == ("bf16", memory)
    assert plan.value("text_encoder_quant") == "fp8" and "28.8 GB -> 15.8 GB" in plan["text_encoder_quant"].reason


@pytest.mark.parametrize(("name", "checkpoint", "steps", "guidance"), [
    ("HiDream-ai/HiDream-I1-Full", "hidream-i1-full", 50, 5.0),
    ("HiDream-ai/HiDream-I1-Dev", "hidream-i1-dev", 28, 0.0),
    ("hidream-i1-fast", "hidream-i1-fast", 16, 0.0),
])
def test_each_checkpoint_samples_its_own_steps(engine_registry: Registry, name: str, checkpoint: str, steps: int,
                                               guidance: float) -> None:
    from engine.preflight.model import resolve_model

    chosen = resolve_model(engine_registry, name).checkpoint
    assert chosen is not None and (chosen.name, chosen.default_steps, chosen.default_guidance) == (checkpoint, steps,
                                                                                                     guidance)


@pytest.mark.slow
def test_the_cli_image_is_the_size_asked_and_equals_plain_hidreamimagepipeline(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The pipeline alone scales 64 x 64 to its 1 MP area; the engine gives the size asked, the
    pipeline's own image at that area."""
    from engine.cli import main

    out = tmp_path / "fox.png"
    status = main(["generate", "--model", str(folder), "--prompt", "a red fox", "--width", "64", "--height", "64",
                   "--steps", "2", "--seed", "5", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    plain = _plain(folder)("a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=5.0,  # type: ignore[operator]
                           generator=_generator(5)).images[0]
    saved = Image.open(out).convert("RGB")
    assert saved.size == (64, 64) and np.array_equal(np.asarray(saved), np.asarray(plain))


def _offline_cache(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return root


def test_a_repo_without_its_llama_is_refused_before_anything_is_evicted(
    engine_registry: Registry, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As HiDream publishes it (Llama named, not shipped), offline with no copy of the mirror:
    refused naming the component and the repo it comes from; the resident model stays."""
    from engine.errors import EngineError
    from engine.service.facade import Engine
    from families.hidream.tiny import write_repo_layout

    from engine.preflight.model import resolve_model
    from families.hidream.table import LLAMA_GB

    repo = write_repo_layout(folder, tmp_path / "HiDream-I1-Full")
    _offline_cache(monkeypatch, tmp_path / "hub")
    sizes = resolve_model(engine_registry, repo).measured_sizes
    assert sizes is not None and sizes.text_encoders_gb > LLAMA_GB  # the encoder it lacks is still counted
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        resident = engine.images.session
        with pytest.raises(EngineError) as refused:
            engine.images.load(str(repo))
        assert engine.images.session is resident
    assert refused.value.code == "component_missing"
    assert "text_encoder_4" in refused.value.message and LLAMA_REPO in refused.value.message


@pytest.mark.slow
def test_a_repo_without_its_llama_takes_it_from_the_named_repo_and_draws_the_full_image(
    engine_registry: Registry, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.service.facade import Engine
    from families.hidream.tiny import write_llama, write_repo_layout

    repo = write_repo_layout(folder, tmp_path / "HiDream-I1-Full")
    cache = _offline_cache(monkeypatch, tmp_path / "hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    cached = cache / f"models--{LLAMA_REPO.replace('/', '--')}"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(commit)
    write_llama(folder, cached / "snapshots" / commit)
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 3}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(repo))
        assert engine.status()["pipeline"]["model"]["borrowed"] == {  # type: ignore[index]
            "text_encoder_4": LLAMA_REPO, "tokenizer_4": LLAMA_REPO}
        borrowed = np.asarray(engine.images.generate("a red fox", **asked)[0])
        engine.images.load(str(folder))
        whole = np.asarray(engine.images.generate("a red fox", **asked)[0])
    assert np.array_equal(borrowed, whole)
