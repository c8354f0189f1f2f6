"""Video through every door: the CLI's MP4 and recipe, engine.videos, and OpenAI's videos API
on a real loopback server (the official client creates, polls and downloads a tiny Wan clip)."""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from engine.runtime import family_hooks
from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.requests import GenerateBody
from engine.runtime.video_files import read_mp4
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer

TOKEN = "video-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wan(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def loaded(wan: Path) -> Iterator[Engine]:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    engine.images.load(str(wan))
    yield engine
    engine.images.unload()


def test_cli_writes_an_mp4_and_its_recipe_which_replays(wan: Path, tmp_path: Path,
                                                        cli_json: Callable[..., object]) -> None:
    out = tmp_path / "clip.mp4"
    report = cli_json("generate", "--model", str(wan), "--prompt", "a fox", "--frames", "9", "--fps", "8",
                      "--steps", "2", "--width", "96", "--height", "64", "--seed", "7", "-o", str(out))
    assert isinstance(report, dict) and report["frames"] == 9 and report["fps"] == 8
    frames, fps = read_mp4(out)
    assert (len(frames), frames[0].size, round(fps)) == (9, (96, 64), 8)
    recipe = json.loads(out.with_suffix(".json").read_text())
    assert {k: recipe[k] for k in ("frames", "fps", "width", "height", "seed", "steps", "checkpoint")} == {
        "frames": 9, "fps": 8, "width": 96, "height": 64, "seed": 7, "steps": 2, "checkpoint": "wan2.2-ti2v-5b"}
    assert "memory_mode" in recipe["engaged"] and recipe["engaged"]["vae_tiling"] == 0
    # The recipe replays: the same request renders the same frames.
    again = tmp_path / "again.mp4"
    cli_json("generate", "--model", str(wan), "--prompt", recipe["prompt"], "--frames", str(recipe["frames"]),
             "--fps", str(recipe["fps"]), "--steps", str(recipe["steps"]), "--width", "96", "--height", "64",
             "--seed", str(recipe["seed"]), "-o", str(again))
    replayed, _ = read_mp4(again)
    assert [f.tobytes() for f in replayed] == [f.tobytes() for f in frames]


def test_image_to_video_starts_from_the_image(loaded: Engine, tmp_path: Path) -> None:
    red = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (240, 20, 20)).save(red)
    text = loaded.videos.generate("a fox", frames=5, steps=2, width=64, height=64, seed=1)
    image = loaded.videos.generate(GenerateBody(prompt="a fox", frames=5, steps=2, width=64, height=64, seed=1,
                                                image=str(red)))
    assert len(image.frames) == 5 and image.recipe["image"] == str(red)
    assert image.frames[0].tobytes() != text.frames[0].tobytes()  # the image conditions the clip


def test_refusals_come_before_the_pipeline_runs(loaded: Engine) -> None:
    from engine.errors import EngineError

    for options, code in (({"frames": 8}, "invalid_video_shape"), ({"width": 80, "height": 64}, "invalid_video_shape"), ({"width": 48}, "invalid_request"),
                          ({"count": 2}, "invalid_request"), ({"image": "/no/such.png"}, "invalid_image")):
        with pytest.raises(EngineError) as refused:
            loaded.videos.generate("a fox", steps=1, **options)
        assert refused.value.code == code, (options, refused.value)
    with pytest.raises(EngineError, match="renders video") as wrong:
        loaded.images.generate("a fox", steps=1)
    assert wrong.value.code == "wrong_output"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, wan: Path) -> Iterator[tuple[str, Engine]]:
    models = tmp_path_factory.mktemp("video-models")
    shutil.copytree(wan, models / "tiny-wan")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    settings = ServerSettings(model_roots=(models,), output_roots=(tmp_path_factory.mktemp("video-outputs"),),
                              token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        loaded = httpx.post(f"{url}/v1/images/load", json={"model": "tiny-wan"}, headers=AUTH, timeout=120)
        assert loaded.status_code == 200, loaded.text
        yield url, engine
        engine.images.unload()


# The client marks its videos methods deprecated for OpenAI's own hosted model; the API is what we serve.
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_openai_client_creates_polls_and_downloads_a_clip(served: tuple[str, Engine]) -> None:
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    # 0.25 s at 24 fps is 6 frame intervals, 7 frames: snapped onto 4k+1 (5), and said so.
    video = client.videos.create(prompt="a red fox", seconds="0.25", size="64x64",  # type: ignore[arg-type]
                                 extra_body={"steps": 2, "seed": 3})
    assert video.status in ("queued", "in_progress") and video.size == "64x64"
    assert video.model_extra["frames"] == 5 and "snapped to 5" in video.model_extra["snapped"]
    deadline = time.monotonic() + 120
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed" and video.progress == 100, video
    frames, fps = read_mp4(client.videos.download_content(video.id).content)
    assert (len(frames), frames[0].size, round(fps)) == (5, (64, 64), 24)
    thumb = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").content))
    assert thumb.size == (64, 64)
    # The clip is kept in the gallery with its recipe, its MP4 and its thumbnail.
    [kept] = [e for e in httpx.get(f"{url}/v1/gallery", params={"kind": "video"}, headers=AUTH).json()["data"]
              if e["job"] == video.id]
    assert kept["recipe"]["frames"] == 5 and kept["recipe"]["kind"] == "video" and kept["media_type"] == "video/mp4"
    mp4 = httpx.get(f"{url}/v1/gallery/{kept['id']}/file", headers=AUTH).content
    assert mp4 == client.videos.download_content(video.id).content
    shown = httpx.get(f"{url}/v1/gallery/{kept['id']}/file", params={"variant": "thumbnail"}, headers=AUTH)
    assert shown.headers["content-type"] == "image/png" and Image.open(io.BytesIO(shown.content)).size == (64, 64)
    assert video.id in [v.id for v in client.videos.list().data]
    assert client.videos.delete(video.id).deleted
    missing = httpx.get(f"{url}/v1/videos/{video.id}", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_video_refusals_over_http_are_422_and_queue_nothing(served: tuple[str, Engine]) -> None:
    url, _ = served
    before = len(httpx.get(f"{url}/v1/videos", headers=AUTH).json()["data"])
    off = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", "frames": "8"}, headers=AUTH)
    assert off.status_code == 422 and off.json()["error"]["code"] == "invalid_video_shape"
    assert "nearest valid counts are 5 and 9" in off.json()["error"]["message"]
    size = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", "size": "70x64"}, headers=AUTH)
    assert size.status_code == 422 and "1280x704, 704x1280" in size.json()["error"]["message"]
    other = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", "model": "no-such-model"}, headers=AUTH)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert len(httpx.get(f"{url}/v1/videos", headers=AUTH).json()["data"]) == before


def test_engine_pipeline_output_reads_frames_or_images_and_a_plugin_may_answer() -> None:
    """The default reads ``.images`` or each clip of ``.frames`` (PIL, or arrays in 0-1) by the
    family's output kind; a plugin's answer (a pipeline returning something else) wins."""
    from types import SimpleNamespace

    import numpy as np

    from engine.contract.hookspecs import hookimpl
    from engine.errors import EngineError

    registry = load_registry()
    wan, sdxl = registry.family("wan"), registry.family("sdxl")
    clip = np.zeros((3, 16, 16, 3), dtype=np.float32) + 0.5
    frames = family_hooks.pipeline_output(registry, wan, None, SimpleNamespace(frames=[clip]))
    assert len(frames) == 1 and len(frames[0]) == 3 and frames[0][0].getpixel((0, 0)) == (128, 128, 128)
    image = Image.new("RGB", (8, 8))
    assert family_hooks.pipeline_output(registry, sdxl, None, SimpleNamespace(images=[image])) == [image]
    with pytest.raises(EngineError, match="output='frames'") as wrong:
        family_hooks.pipeline_output(registry, sdxl, None, SimpleNamespace(frames=[clip]))
    assert wrong.value.code == "unreadable_output"

    class AudioClips:
        @hookimpl
        def engine_pipeline_output(self, family: object, pipeline: object, result: object) -> list[object] | None:
            return [["frame"]] if hasattr(result, "audio") else None

    registry._pm.register(AudioClips(), name="audio-clips")
    try:
        assert family_hooks.pipeline_output(registry, wan, None, SimpleNamespace(audio=b"", video=None)) == [["frame"]]
    finally:
        registry._pm.unregister(name="audio-clips")


@pytest.mark.parametrize(("model", "fields", "code"), [
    ("wan", {"frames": 80}, "invalid_video_shape"),            # off the 4k+1 lattice
    ("wan", {"frames": 13, "window_frames": 6}, "invalid_video_shape"),  # windows off the lattice
    ("ltx2", {"frames": 265}, "invalid_video_shape"),          # past its window, and its sound cannot be carried
    ("wan", {"width": 80, "height": 64}, "invalid_video_shape"),  # off TI2V's multiple of 32
    ("wan", {"count": 2}, "invalid_request"),                  # one clip per call
    ("wan", {"image": "/no/such/first.png"}, "invalid_image"),  # image to video without its image
    ("sdxl", {"frames": 9}, "wrong_output"),                   # frames asked of an image model
    ("minimax_h3", {"fps": 30}, "invalid_video_shape"),        # a model that renders at 24 fps only
    ("minimax_h3", {"frames": 121}, "invalid_video_shape"),    # off its 17k+5 lattice (a modular pipeline)
])
def test_a_doomed_video_request_evicts_nothing(tiny_pipeline: Callable[[str], Path], model: str,
                                               fields: dict[str, object], code: str) -> None:
    """The 0-eviction matrix's video cases: refused at the check, the host's model left resident."""
    from engine.errors import EngineError
    from tests.support import HostModel

    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    host = HostModel(engine)
    door = engine.images if model == "sdxl" else engine.videos  # a clip file asked of the model
    with pytest.raises(EngineError) as refused:
        door.check_generate(GenerateBody(prompt="a fox", model=str(tiny_pipeline(model)), **fields))
    assert refused.value.code == code, refused.value
    assert host.evicted == 0 and engine.images.session is None


def test_one_refusal_through_every_door(served: tuple[str, Engine], wan: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A frame count off the lattice: the same code and the same words from Python, HTTP and the
    CLI (each naming the field as its caller spells it), and nothing rendered by any."""
    from engine.cli import main
    from engine.errors import EngineError

    url, engine = served
    with pytest.raises(EngineError) as python:
        engine.videos.generate("a fox", frames=80, steps=1)
    http = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", "frames": "80"}, headers=AUTH).json()["error"]
    capsys.readouterr()
    status = main(["generate", "--model", str(wan), "--prompt", "a fox", "--frames", "80", "-o",
                   str(tmp_path / "clip.mp4")])
    cli = capsys.readouterr().err
    words = "cannot render that clip (its VAE compresses time by 4, so a frame count must be 4k+1); " \
            "the nearest valid counts are 77 and 81"
    assert python.value.code == http["code"] == "invalid_video_shape" and status == 2
    assert words in python.value.message and words in http["message"] and words in cli
    assert python.value.message.startswith("frames=80: ") and "error[invalid_video_shape]: --frames 80" in cli
    assert not (tmp_path / "clip.mp4").exists()
