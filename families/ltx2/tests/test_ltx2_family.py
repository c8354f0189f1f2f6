"""The ltx2 plugin: the contract kit (its clip's sound included), a clip with its sound through
the CLI, Python and OpenAI's videos API, the same frames and samples as plain ``LTX2Pipeline``,
the request's fps reaching the pipeline's ``frame_rate``, and plans on the cards people use."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.runtime.video_files import read_mp4, read_sound
from engine.testing import FamilyContract
from families.ltx2.table import AUDIO_RATE
from families.ltx2.tiny import TINY_FRAMES, TINY_RESOLUTION

TOKEN = "ltx2-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class TestLTX2Kit(FamilyContract):
    family_name = "ltx2"


@pytest.fixture(scope="module")
def ltx2(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("ltx2")


def _tiny_clip(**extra: object) -> dict[str, object]:
    return {"frames": TINY_FRAMES, "width": TINY_RESOLUTION, "height": TINY_RESOLUTION, "steps": 2, "seed": 3,
            **extra}


def test_ltx2_plans_on_the_cards_people_use(engine_registry: Registry) -> None:
    """37.8 GB of DiT: streamed on a 4090 (it does not fit even quantised), resident on an H100."""
    from tests.support import table_plan

    home, datacentre = table_plan("ltx2", "rtx4090"), table_plan("ltx2", "h100")
    assert home.value("memory_mode") == "group_offload" and "37.8 GB" in home["memory_mode"].reason
    assert datacentre.value("memory_mode") == "resident" and datacentre.value("dtype") == "bf16"
    spec = engine_registry.family("ltx-2").video_of(None)
    assert spec is not None and (spec.audio, spec.audio_rate, spec.lattice) == (True, AUDIO_RATE, "8k+1")


@pytest.mark.slow
def test_the_cli_writes_a_clip_with_its_sound(ltx2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An MP4 with an H.264 and an AAC stream: 24 kHz stereo as long as the picture (it dropped
    the track), and the recipe says so."""
    from engine.cli import main

    out = tmp_path / "clip.mp4"
    clip = _tiny_clip()
    status = main(["generate", "--model", str(ltx2), "--prompt", "a fox", "--frames", str(clip["frames"]),
                   "--width", "64", "--height", "64", "--steps", "2", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    frames, fps = read_mp4(out)
    sound = read_sound(out)
    assert len(frames) == TINY_FRAMES and round(fps) == 24
    assert sound is not None and (sound.sample_rate, sound.channels) == (AUDIO_RATE, 2)
    assert abs(sound.seconds - TINY_FRAMES / 24) < 0.1 and float(np.abs(sound.samples).max()) > 0
    recipe = json.loads(out.with_suffix(".json").read_text())
    assert recipe["audio"]["sample_rate"] == AUDIO_RATE and recipe["audio"]["channels"] == 2


@pytest.mark.slow
def test_the_engine_clip_equals_plain_ltx2pipeline_and_fps_sets_the_sounds_length(
    ltx2: Path, engine_registry: Registry,
) -> None:
    """The same seed gives plain diffusers' frames and samples; the request's fps reaches the
    pipeline's ``frame_rate`` (half the fps, the same frames: twice the sound)."""
    import torch
    from diffusers import LTX2Pipeline

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        asked = {"prompt": "a fox", "model": str(ltx2), "guidance": 1.0, **_tiny_clip()}
        clip = engine.videos.generate(GenerateBody(**asked))  # type: ignore[arg-type]
        slow = engine.videos.generate(GenerateBody(**asked, fps=12))  # type: ignore[arg-type]
    from engine.testing.stock import planned_dtypes

    plain = LTX2Pipeline.from_pretrained(str(ltx2), dtype=planned_dtypes(ltx2))(
        prompt="a fox", height=64, width=64, num_frames=TINY_FRAMES, frame_rate=24.0, num_inference_steps=2,
        guidance_scale=1.0, generator=torch.Generator("cpu").manual_seed(3), output_type="pil")
    assert [f.tobytes() for f in clip.frames] == [f.convert("RGB").tobytes() for f in plain.frames[0]]
    assert clip.sound is not None and np.allclose(clip.sound.samples, plain.audio[0].float().numpy(), atol=1e-6)
    assert slow.sound is not None and slow.sound.seconds == pytest.approx(2 * clip.sound.seconds, rel=0.15)


@pytest.mark.slow
def test_the_distilled_checkpoint_samples_its_own_sigmas_and_refuses_other_step_counts(
    engine_registry: Registry, tmp_path: Path,
) -> None:
    """LTX-2.3 Distilled: eight steps on its distilled sigmas at guidance 1.0, as plain
    ``LTX2Pipeline`` given those sigmas renders it; another step count is refused at the check,
    before anything is evicted."""
    import torch
    from diffusers import LTX2Pipeline

    from engine.errors import EngineError
    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine
    from families.ltx2.table import DISTILLED_SIGMAS
    from families.ltx2.tiny import build_tiny_pipeline
    from tests.support import HostModel

    folder = build_tiny_pipeline(tmp_path / "ltx-2.3-distilled-tiny")
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        host = HostModel(engine)
        asked = {"prompt": "a fox", "model": str(folder), **_tiny_clip()}
        asked.pop("steps")
        with pytest.raises(EngineError) as refused:
            engine.videos.check_generate(GenerateBody(**asked, steps=4))  # type: ignore[arg-type]
        assert refused.value.code == "invalid_request" and "8 sigmas it was distilled on" in refused.value.message
        assert host.evicted == 0 and engine.images.session is None
        steps: list[int] = []
        clip = engine.videos.generate(GenerateBody(**asked), progress=lambda done, _t: steps.append(done))  # type: ignore[arg-type]
        assert clip.recipe["checkpoint"] == "ltx-2.3-distilled" and steps[-1] == 8
    from engine.testing.stock import planned_dtypes

    plain = LTX2Pipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder))(
        prompt="a fox", height=64, width=64, num_frames=TINY_FRAMES, frame_rate=24.0, num_inference_steps=8,
        sigmas=list(DISTILLED_SIGMAS), guidance_scale=1.0, generator=torch.Generator("cpu").manual_seed(3),
        output_type="pil")
    assert [f.tobytes() for f in clip.frames] == [f.convert("RGB").tobytes() for f in plain.frames[0]]


@pytest.mark.slow
def test_image_to_video_starts_from_the_image_and_keeps_its_sound(ltx2: Path, engine_registry: Registry,
                                                                  tmp_path: Path) -> None:
    """``--image`` runs ``LTX2ImageToVideoPipeline`` over the loaded components: the clip
    starts from the picture, and its sound is there too."""
    from PIL import Image

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    red = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (240, 20, 20)).save(red)
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        asked = {"prompt": "a fox", "model": str(ltx2), **_tiny_clip()}
        text = engine.videos.generate(GenerateBody(**asked))  # type: ignore[arg-type]
        image = engine.videos.generate(GenerateBody(**asked, image=str(red)))  # type: ignore[arg-type]
        built = {type(pipe).__name__ for pipe in engine.images.session._workflow_pipes.values()}  # type: ignore[union-attr]
    assert "LTX2ImageToVideoPipeline" in built
    assert image.recipe["image"] == str(red) and len(image.frames) == TINY_FRAMES
    assert image.frames[0].tobytes() != text.frames[0].tobytes() and image.sound is not None


@pytest.mark.slow
def test_a_lora_changes_the_clips_picture_and_sound_and_scale_zero_is_the_base(
    ltx2: Path, engine_registry: Registry, tmp_path: Path,
) -> None:
    """A peft LoRA on the DiT's attention (its video and audio streams alike) through the
    engine's LoRA door: the picture and the sound both move; at scale 0 the clip is the base's."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel
    from peft import LoraConfig, get_peft_model_state_dict

    from engine.testing.sound_training import check_lora_moves_clip

    transformer = LTX2VideoTransformer3DModel.from_pretrained(str(ltx2), subfolder="transformer")
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch.manual_seed(1)
    for name, parameter in transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    from diffusers import LTX2Pipeline

    lora = tmp_path / "lora"
    LTX2Pipeline.save_lora_weights(lora, transformer_lora_layers=get_peft_model_state_dict(transformer))
    check_lora_moves_clip(engine_registry, {"prompt": "a fox", "model": str(ltx2), **_tiny_clip()}, lora)


@pytest.mark.slow
def test_engine_pipeline_sound_a_family_that_drops_its_sound_fails_the_kit(engine_registry: Registry, ltx2: Path, tmp_path: Path) -> None:
    """A plugin declaring sound whose output loses the track is caught by the kit's model check."""
    from engine.contract.hookspecs import hookimpl
    from engine.testing.run import run_model

    class Silent:
        @hookimpl
        def engine_pipeline_sound(self, family: object, pipeline: object, result: object) -> list[object]:
            return [None]

    engine_registry._pm.register(Silent(), name="silent-ltx2")
    try:
        report = run_model(engine_registry, engine_registry.family("ltx2"), tmp_path, folder=ltx2)
    finally:
        engine_registry._pm.unregister(name="silent-ltx2")
    assert report.failure is not None and "no audio stream" in report.failure


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ltx2: Path) -> Iterator[str]:
    from engine.contract.plugins import load_registry
    from engine.hardware.probe import probe
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    models = tmp_path_factory.mktemp("ltx2-models")
    shutil.copytree(ltx2, models / "tiny-ltx2")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    settings = ServerSettings(model_roots=(models,), output_roots=(tmp_path_factory.mktemp("ltx2-out"),), token=TOKEN)
    with engine, LiveServer(create_app(engine, settings)) as url:
        yield url


# The client marks its videos methods deprecated for OpenAI's own hosted model; the API is what we serve.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_openai_client_downloads_a_clip_with_its_sound(served: str) -> None:
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{served}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    video = client.videos.create(prompt="a red fox", model="tiny-ltx2", size="64x64",  # type: ignore[arg-type]
                                 extra_body={"frames": TINY_FRAMES, "steps": 2, "seed": 3})
    deadline = time.monotonic() + 120
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video
    assert video.model_extra["audio"]["sample_rate"] == AUDIO_RATE  # type: ignore[index]
    mp4 = client.videos.download_content(video.id).content
    sound = read_sound(mp4)
    assert sound is not None and sound.sample_rate == AUDIO_RATE and len(read_mp4(mp4)[0]) == TINY_FRAMES
    wav = httpx.get(f"{served}/v1/videos/{video.id}/content", params={"variant": "wav"}, headers=AUTH)
    assert wav.headers["content-type"] == "audio/wav" and wav.content[:4] == b"RIFF"
