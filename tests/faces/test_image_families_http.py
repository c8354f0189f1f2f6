"""The 2026 image families through OpenAI's images API: each family's tiny pipeline, named by
its folder in the request, loads behind a real server on loopback and answers a PNG of the size
asked (the model switched per request, as a client naming several models does)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

FAMILIES = ["krea2", "qwen_image21", "ideogram4", "hidream", "hunyuan_image", "lumina2", "flux3"]


@pytest.fixture(scope="module")
def served(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One server whose model root holds every family's tiny pipeline (linked, not copied), each
    with its own two-step default (``diffusion_engine.json``): OpenAI's body names no steps."""
    from engine.hardware.probe import probe
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    root = tmp_path_factory.mktemp("image-families")
    for family in FAMILIES:
        shutil.copytree(tiny_pipeline(family), root / family, copy_function=os.link)
        (root / family / "diffusion_engine.json").write_text(json.dumps({"defaults": {"steps": 2}}), encoding="utf-8")
    engine = Engine(hardware=probe(verify=False))
    try:
        with LiveServer(create_app(engine, ServerSettings(model_roots=(root,)))) as url:
            yield url, root
    finally:
        engine.images.unload()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_answers_openais_images_api(served: tuple[str, Path], family: str) -> None:
    url, root = served
    answer = httpx.post(f"{url}/v1/images/generations", timeout=300, json={
        "prompt": "a red fox", "model": str(root / family), "size": "64x64", "response_format": "b64_json"})
    assert answer.status_code == 200, answer.text
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert image.size == (64, 64)
    low, high = image.convert("L").getextrema()
    assert low < high  # a picture, not a flat fill
