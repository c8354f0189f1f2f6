"""Each decision once per request, through every door: the generate ticket.

A review counted one clip deciding its shape twice on the CLI and three times over
HTTP, and its input image checked up to three times. Here one generate of an image
(img2img: an input image) and one of a clip (image to video), from the CLI, over HTTP
and from Python, each resolve the model once, plan once, size each input image from
its header once and decide a clip's shape once; the CLI makes at most five calls into
the engine. The machine is a fixed profile (only the hardware is faked), so no figure
here moves with the host's load or free memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engine import Engine
from engine.hardware import probe as hardware_probe
from engine.policy import inference, video
from engine.preflight import images as preflight_images
from engine.preflight import model as preflight_model
from engine.requests import GenerateBody
from tests.support import LiveServer, counted, engine_calls

DECISIONS = (preflight_model.resolve_model, inference.plan_inference, video.video_shape, preflight_images.image_size)
ONCE_IMAGE = {"resolve_model": 1, "plan_inference": 1, "image_size": 1}
ONCE_CLIP = {**ONCE_IMAGE, "video_shape": 1}


@pytest.fixture()
def picture(tmp_path: Path) -> Path:
    path = tmp_path / "inputs" / "red.png"
    path.parent.mkdir()
    Image.new("RGB", (64, 64), (220, 30, 30)).save(path)
    return path


def _bound() -> None:
    """Import every module that binds a counted function before counting (as a run binds them)."""
    import engine.cli.images  # noqa: F401
    import engine.service.generating  # noqa: F401
    import engine.service.load_checks  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["image", "clip"])
def test_one_cli_generate_decides_each_thing_once_in_five_engine_calls(
    kind: str, cli_json: Callable[..., object], tiny_pipeline: Callable[[str], Path], picture: Path,
    tmp_path: Path, fixed_machine: None,
) -> None:
    from engine.service.images import Images
    from engine.service.videos import Videos

    _bound()
    model = tiny_pipeline("wan" if kind == "clip" else "sdxl")
    shape = ["--frames", "5", "-o", str(tmp_path / "out.mp4")] if kind == "clip" else [
        "--strength", "0.5", "-o", str(tmp_path / "out.png")]
    with counted(*DECISIONS) as decided, engine_calls(Engine, Images, Videos) as calls:
        done = cli_json("generate", "--model", str(model), "--prompt", "a fox", "--image", str(picture),
                        "--steps", "2", "--width", "64", "--height", "64", "--seed", "1", *shape)
    assert isinstance(done, dict) and Path(str(done.get("video") or done["images"][0])).is_file()
    assert decided == (ONCE_CLIP if kind == "clip" else ONCE_IMAGE), decided
    door = "Videos" if kind == "clip" else "Images"
    assert calls == [f"{door}.check_generate", "Images.prepare_runtime", f"{door}.load", f"{door}.generate",
                     "Engine.close"], calls
    assert len(calls) <= 5


@pytest.fixture()
def served(tiny_pipeline: Callable[[str], Path], picture: Path, fixed_machine: None) -> Iterator[tuple[str, Engine]]:
    from engine.server.app import create_app
    from engine.server.settings import ServerSettings

    engine = Engine(hardware=hardware_probe.probe(verify=False))
    settings = ServerSettings(model_roots=(tiny_pipeline("sdxl").parent, tiny_pipeline("wan").parent),
                              input_roots=(picture.parent,))
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine
    engine.close()


@pytest.mark.slow
def test_one_http_generate_decides_each_thing_once(served: tuple[str, Engine], tiny_pipeline: Callable[[str], Path],
                                                   picture: Path) -> None:
    url, _ = served
    _bound()
    body = {"prompt": "a fox", "model": str(tiny_pipeline("sdxl")), "image": str(picture), "strength": 0.5,
            "steps": 2, "width": 64, "height": 64}
    with counted(*DECISIONS) as decided:
        answer = httpx.post(f"{url}/v1/images/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert decided == ONCE_IMAGE, decided


@pytest.mark.slow
def test_one_http_clip_decides_each_thing_once(served: tuple[str, Engine], tiny_pipeline: Callable[[str], Path],
                                               picture: Path) -> None:
    import time

    url, _ = served
    _bound()
    form = {"prompt": "a fox", "model": str(tiny_pipeline("wan")), "seconds": "0.2", "size": "64x64", "steps": "1"}
    with counted(*DECISIONS) as decided:
        made = httpx.post(f"{url}/v1/videos", data=form, files={"input_reference": picture.read_bytes()}, timeout=60)
        assert made.status_code == 200, made.text
        for _ in range(3000):  # a bound for a hung job only: the clip takes a second or two
            state = httpx.get(f"{url}/v1/videos/{made.json()['id']}").json()
            if state["status"] not in ("queued", "in_progress"):
                break
            time.sleep(0.1)
    assert state["status"] == "completed", state
    assert decided == ONCE_CLIP, decided


@pytest.mark.parametrize("kind", ["image", "clip"])
def test_one_python_generate_decides_each_thing_once(kind: str, tiny_pipeline: Callable[[str], Path],
                                                     picture: Path, fixed_machine: None) -> None:
    _bound()
    engine = Engine()
    asked: dict[str, Any] = {"frames": 5} if kind == "clip" else {"strength": 0.5}
    body = GenerateBody(prompt="a fox", model=str(tiny_pipeline("wan" if kind == "clip" else "sdxl")),
                        image=str(picture), steps=2, width=64, height=64, **asked)
    door = engine.videos if kind == "clip" else engine.images
    with counted(*DECISIONS) as decided, engine:
        door.generate(body)
    assert decided == (ONCE_CLIP if kind == "clip" else ONCE_IMAGE), decided


def test_a_ticket_runs_without_deciding_again_and_an_input_rewritten_since_is_checked_again(
    tiny_pipeline: Callable[[str], Path], picture: Path, fixed_machine: None,
) -> None:
    import os

    _bound()
    with Engine() as engine:
        ticket = engine.images.check_generate(GenerateBody(prompt="a fox", model=str(tiny_pipeline("sdxl")),
                                                           image=str(picture), strength=0.5, steps=2))
        with counted(*DECISIONS) as decided:
            engine.images.generate(ticket)
        assert decided == {}, decided  # the ticket's decisions, nothing re-decided
        Image.new("RGB", (64, 32), (0, 0, 0)).save(picture)
        os.utime(picture, ns=(1, 1))
        with counted(*DECISIONS) as decided:
            [image] = engine.images.generate(ticket)
        assert decided == {"image_size": 1}, decided  # the loaded model kept; the new image read again
        assert image.size == (64, 32)
