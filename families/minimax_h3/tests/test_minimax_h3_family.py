"""The minimax_h3 plugin: the contract kit (its clip's sound included) over a modular pipeline,
a clip with its sound through the CLI and Python equal to plain ``MiniMaxH3ModularPipeline``,
a folder loaded from itself whatever its index names, refusals before anything is evicted, and
plans on the cards people use."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.runtime.video_files import read_mp4, read_sound
from engine.testing import FamilyContract
from families.minimax_h3.table import AUDIO_RATE
from families.minimax_h3.tiny import TINY_FRAMES, TINY_RESOLUTION


class TestMiniMaxH3Kit(FamilyContract):
    family_name = "minimax_h3"


@pytest.fixture(scope="module")
def h3(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("minimax_h3")


def _tiny_clip(**extra: object) -> dict[str, object]:
    return {"frames": TINY_FRAMES, "width": TINY_RESOLUTION, "height": TINY_RESOLUTION, "steps": 2, "seed": 3,
            **extra}


def test_minimax_h3_plans_on_the_cards_people_use(engine_registry: Registry) -> None:
    """66.3 GB of DiT and 66.8 of encoder: streamed on a 4090, and on an H100 the encoders wait
    off the card; its clips are 17k+5 frames at 24 fps with 32 kHz sound."""
    from tests.support import table_plan

    home, datacentre = table_plan("minimax_h3", "rtx4090"), table_plan("minimax_h3", "h100")
    assert home.value("memory_mode") != "resident" and "66.3 GB" in home["memory_mode"].reason
    assert datacentre.value("dtype") == "bf16"
    spec = engine_registry.family("minimax-h3").video_of(None)
    assert spec is not None and (spec.audio, spec.audio_rate, spec.lattice) == (True, AUDIO_RATE, "17k+5")
    assert spec.latent_frames(124) == 37 and spec.latent_frames(345) == 102  # 17 frames into 5 latents


@pytest.mark.slow
def test_the_cli_writes_a_clip_with_its_sound(h3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An MP4 with an H.264 and an AAC stream: 32 kHz stereo as long as the 5 s picture."""
    from engine.cli import main

    out = tmp_path / "clip.mp4"
    status = main(["generate", "--model", str(h3), "--prompt", "a fox", "--frames", str(TINY_FRAMES),
                   "--width", "64", "--height", "64", "--steps", "2", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    frames, fps = read_mp4(out)
    sound = read_sound(out)
    assert len(frames) == TINY_FRAMES and round(fps) == 24
    assert sound is not None and (sound.sample_rate, sound.channels) == (AUDIO_RATE, 2)
    assert abs(sound.seconds - TINY_FRAMES / 24) < 0.1 and float(np.abs(sound.samples).max()) > 0
    recipe = json.loads(out.with_suffix(".json").read_text())
    assert recipe["audio"]["sample_rate"] == AUDIO_RATE and recipe["latent_frames"] == 37


@pytest.mark.slow
def test_the_engine_clip_equals_plain_modular_pipeline_loaded_from_the_folder_alone(
    h3: Path, engine_registry: Registry, tmp_path: Path,
) -> None:
    """The same seed gives plain diffusers' frames and samples, with every pass reported. The
    folder's index names the published repo (as a download's does) and is copied elsewhere with
    no network: the engine loads every component from the folder it lies in."""
    import shutil

    import torch
    from diffusers import ComponentsManager, ModularPipeline

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    moved = tmp_path / "elsewhere" / "minimax-h3"
    shutil.copytree(h3, moved)
    index = json.loads((moved / "modular_model_index.json").read_text())
    assert index["transformer"][2]["pretrained_model_name_or_path"] == "MiniMaxAI/MiniMax-H3"
    steps: list[int] = []
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        clip = engine.videos.generate(GenerateBody(prompt="a fox", model=str(moved), **_tiny_clip()),  # type: ignore[arg-type]
                                      progress=lambda done, _total: steps.append(done))
        held = engine.images.session._pipe  # type: ignore[union-attr]
        assert type(held._pipe).__name__ == "MiniMaxH3ModularPipeline"
        assert {name for name in held.components} >= {"transformer", "vae", "audio_vae", "text_encoder"}
        swapped = type(held.scheduler)(shift=5.0)
        held.scheduler = swapped  # a component set on the runner is the pipeline's
        assert held._pipe.scheduler is swapped and held.scheduler is swapped
    assert steps[-1] == 1  # its scheduler's grid has `steps` points: 2 of them are 1 transformer pass
    plain = ModularPipeline.from_pretrained(str(h3), components_manager=ComponentsManager())
    from engine.testing.stock import planned_dtypes

    plain.load_components(names=["transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler",
                                 "audio_scheduler"], torch_dtype=planned_dtypes(h3))
    from engine.runtime.processors import build_processor

    plain.update_components(processor=build_processor(h3 / "processor", "Qwen3VLProcessor"))
    out = plain(prompt="a fox", height=64, width=64, num_frames=TINY_FRAMES, num_inference_steps=2,
                generator=torch.Generator("cpu").manual_seed(3), output_type="pil", output=["videos", "audio"])
    assert [f.tobytes() for f in clip.frames] == [f.convert("RGB").tobytes() for f in out["videos"][0]]
    assert clip.sound is not None and np.allclose(clip.sound.samples, out["audio"][0].float().numpy(), atol=1e-6)


def test_a_folder_missing_a_component_is_refused_and_the_reference_partition_is_not_needed(
    h3: Path, engine_registry: Registry, tmp_path: Path,
) -> None:
    """The preflight reads the modular index as a classic one: a component it lists and the folder
    lacks is refused by name before anything is evicted; ``transformer_ref`` (the references
    workflow's partition, another 61.7 GB) is never required."""
    import shutil

    from engine.errors import EngineError
    from engine.hardware.probe import probe
    from engine.preflight.model import resolve_model
    from engine.requests import GenerateBody
    from engine.service.facade import Engine
    from tests.support import HostModel

    folder = tmp_path / "minimax-h3"
    shutil.copytree(h3, folder)
    index = json.loads((folder / "modular_model_index.json").read_text())
    index["transformer_ref"] = ["diffusers", "MiniMaxH3Transformer3DModel", dict(index["transformer"][2],
                                                                                    subfolder="transformer_ref")]
    (folder / "modular_model_index.json").write_text(json.dumps(index))
    source = resolve_model(engine_registry, folder)
    assert source.family.name == "minimax_h3" and source.kind == "pipeline"
    assert source.measured_sizes is not None and source.measured_sizes.vae_gb > 0  # the audio VAE counted too
    shutil.rmtree(folder / "audio_vae")
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        host = HostModel(engine)
        with pytest.raises(EngineError) as refused:
            engine.videos.check_generate(GenerateBody(prompt="a fox", model=str(folder), **_tiny_clip()))  # type: ignore[arg-type]
        assert host.evicted == 0 and engine.images.session is None
    assert refused.value.code == "model_file_missing" and "audio_vae" in refused.value.message


@pytest.mark.slow
def test_an_image_is_its_first_keyframe(h3: Path, engine_registry: Registry, tmp_path: Path) -> None:
    """``--image`` runs the modular pipeline's keyframe workflow (the blocks pick it from the
    input): the clip differs from text alone and keeps its sound."""
    from PIL import Image

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    red = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (240, 20, 20)).save(red)
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        asked = {"prompt": "a fox", "model": str(h3), **_tiny_clip()}
        text = engine.videos.generate(GenerateBody(**asked))  # type: ignore[arg-type]
        image = engine.videos.generate(GenerateBody(**asked, image=str(red)))  # type: ignore[arg-type]
    assert image.recipe["image"] == str(red) and len(image.frames) == TINY_FRAMES
    assert [f.tobytes() for f in image.frames] != [f.tobytes() for f in text.frames]
    assert image.sound is not None and image.sound.sample_rate == AUDIO_RATE


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_openai_client_downloads_a_clip_with_its_sound(h3: Path, tmp_path: Path) -> None:
    """The official client against a loopback server: the video object says the sound, the MP4
    carries it, and the WAV variant serves it alone."""
    import shutil
    import time

    import httpx
    from openai import OpenAI

    from engine.contract.plugins import load_registry
    from engine.hardware.probe import probe
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    models = tmp_path / "models"
    shutil.copytree(h3, models / "tiny-h3")
    settings = ServerSettings(model_roots=(models,), output_roots=(tmp_path / "out",), token="h3-token")
    (tmp_path / "out").mkdir()
    with Engine(registry=load_registry(), hardware=probe(verify=False)) as engine, \
            LiveServer(create_app(engine, settings)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="h3-token", max_retries=0, timeout=120)
        video = client.videos.create(prompt="rain on a roof", model="tiny-h3", size="64x64",  # type: ignore[arg-type]
                                     extra_body={"frames": TINY_FRAMES, "steps": 2, "seed": 3})
        deadline = time.monotonic() + 120
        while video.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
            video = client.videos.retrieve(video.id)
        assert video.status == "completed", video
        assert video.model_extra["audio"]["sample_rate"] == AUDIO_RATE  # type: ignore[index]
        mp4 = client.videos.download_content(video.id).content
        wav = httpx.get(f"{url}/v1/videos/{video.id}/content", params={"variant": "wav"},
                        headers={"Authorization": "Bearer h3-token"})
    sound = read_sound(mp4)
    assert sound is not None and sound.sample_rate == AUDIO_RATE and len(read_mp4(mp4)[0]) == TINY_FRAMES
    assert wav.headers["content-type"] == "audio/wav" and wav.content[:4] == b"RIFF"
