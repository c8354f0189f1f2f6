"""The gallery: every output a server makes kept with its recipe, listed and paged, pinned and
deleted, read back by a restarted server, and bounded by size and age (the oldest unpinned go
first). Real files in a real folder; over HTTP, a real server on loopback with a tiny pipeline."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engine.contract.plugins import load_registry
from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.service.gallery import ORPHAN_S, Gallery
from tests.support import LiveServer

TOKEN = "gallery-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SMALL = {"steps": 1, "width": 64, "height": 64}


def png(shade: int, side: int = 16) -> bytes:
    """A real PNG of seeded noise: the same bytes for the same ``shade``, each about the same size."""
    import numpy as np

    pixels = np.random.default_rng(shade).integers(0, 256, (side, side, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def keep(gallery: Gallery, count: int, **recipe: Any) -> list[str]:
    ids = []
    for n in range(count):
        ids.append(gallery.add("image", png(n), recipe={"prompt": f"p{n}", **recipe}, width=16, height=16).id)
        time.sleep(0.002)  # distinct creation times: "oldest" is well defined
    return ids


def test_entries_page_newest_first_pin_delete_and_come_back_after_a_reopen(tmp_path: Path) -> None:
    gallery = Gallery(tmp_path / "g")
    ids = keep(gallery, 5)
    first = gallery.page(limit=2)
    assert [e["id"] for e in first["data"]] == ids[::-1][:2] and first["total"] == 5 and first["next_offset"] == 2
    last = gallery.page(offset=4, limit=2)
    assert [e["id"] for e in last["data"]] == [ids[0]] and last["next_offset"] is None
    assert gallery.pin(ids[1]).pinned and gallery.get(ids[1]).pinned
    gallery.delete(ids[2])
    assert not any((tmp_path / "g").glob(f"{ids[2]}*"))
    with pytest.raises(EngineError) as gone:
        gallery.get(ids[2])
    assert gone.value.code == "gallery_entry_not_found"
    again = Gallery(tmp_path / "g")  # a restarted server
    assert [e["id"] for e in again.page()["data"]] == [ids[4], ids[3], ids[1], ids[0]]
    assert again.get(ids[1]).pinned and again.page(pinned=True)["total"] == 1
    path, media = again.file(ids[0])
    assert media == "image/png" and path.read_bytes() == png(0)
    for hostile in ("../g", ids[0] + "/../x", ids[0].upper(), "0" * 31):
        with pytest.raises(EngineError):
            again.file(hostile)


def test_the_size_bound_removes_the_oldest_unpinned_and_keeps_pinned(tmp_path: Path) -> None:
    one = len(png(0))
    gallery = Gallery(tmp_path / "g", max_bytes=int(one * 3.5))
    ids = keep(gallery, 3)
    gallery.pin(ids[0])  # the oldest, pinned: it stays
    ids += keep(gallery, 2)
    listed = [e["id"] for e in gallery.page()["data"]]
    assert listed == [ids[4], ids[3], ids[0]], "the two oldest unpinned went; the pinned oldest stayed"
    assert gallery.page()["bytes"] <= int(one * 3.5)
    assert sorted(p.stem for p in (tmp_path / "g").glob("*.png")) == sorted(listed)


def test_the_age_bound_and_a_cut_short_write(tmp_path: Path) -> None:
    gallery = Gallery(tmp_path / "g")
    old, fresh, pinned = keep(gallery, 3)
    gallery.pin(pinned)
    for entry_id in (old, pinned):  # an entry's age is its file's, whatever its record says
        os.utime(tmp_path / "g" / f"{entry_id}.png", (time.time() - 7200,) * 2)
    record = tmp_path / "g" / f"{fresh}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "created": time.time() - 7200}))
    orphan = tmp_path / "g" / ("a" * 32 + ".png")  # a write cut short an hour ago: no record
    orphan.write_bytes(png(9))
    os.utime(orphan, (time.time() - ORPHAN_S - 5,) * 2)
    recent = tmp_path / "g" / ("b" * 32 + ".png")  # another process writing now: left alone
    recent.write_bytes(png(8))
    aged = Gallery(tmp_path / "g", max_age_s=3600)
    assert {e["id"] for e in aged.page()["data"]} == {fresh, pinned}
    assert not orphan.exists() and recent.exists() and not (tmp_path / "g" / f"{old}.png").exists()
    with pytest.raises(EngineError, match="max_age_s must be a positive number"):
        Gallery(tmp_path / "g", max_age_s=0)


# -- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> Iterator[tuple[str, Engine, Path]]:
    base = tmp_path_factory.mktemp("gallery")
    shutil.copytree(tiny_pipeline("sdxl"), base / "models" / "tiny-sdxl")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=base / "outputs")
    engine.images.load(str(base / "models" / "tiny-sdxl"))
    settings = ServerSettings(model_roots=(base / "models",), output_roots=(base / "outputs",), token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, base


def test_every_generate_is_kept_with_its_recipe_and_served_from_the_gallery(served: tuple[str, Engine, Path]) -> None:
    url, engine, base = served
    answer = httpx.post(f"{url}/v1/images/generate", json={"prompt": "a red fox", "seeds": [3, 4], **SMALL},
                        headers=AUTH, timeout=120).json()
    assert len(answer["gallery"]) == 2
    listed = httpx.get(f"{url}/v1/gallery", params={"limit": 1}, headers=AUTH).json()
    assert listed["total"] >= 2 and listed["next_offset"] == 1 and len(listed["data"]) == 1
    for entry_id, image in zip(answer["gallery"], answer["images"]):
        entry = httpx.get(f"{url}/v1/gallery/{entry_id}", headers=AUTH).json()
        recipe = entry["recipe"]
        assert entry["kind"] == "image" and (entry["width"], entry["height"]) == (64, 64) and entry["job"]
        assert recipe["prompt"] == "a red fox" and recipe["family"] == "sdxl" and recipe["steps"] == 1
        assert recipe["model"].endswith("tiny-sdxl") and "memory_mode" in recipe["engaged"]  # what engaged
        file = httpx.get(f"{url}/v1/gallery/{entry_id}/file", headers=AUTH)
        assert file.headers["content-type"] == "image/png" and file.content == base64.b64decode(image)
    seeds = [httpx.get(f"{url}/v1/gallery/{i}", headers=AUTH).json()["recipe"]["seed"] for i in answer["gallery"]]
    assert seeds == [3, 4]  # each image's own seed: it replays alone
    # The recipe replays: the same request from its record gives the same pixels.
    recipe = httpx.get(f"{url}/v1/gallery/{answer['gallery'][1]}", headers=AUTH).json()["recipe"]
    again = httpx.post(f"{url}/v1/images/generate", json={
        "prompt": recipe["prompt"], "seed": recipe["seed"], "steps": recipe["steps"], "guidance": recipe["guidance"],
        "width": 64, "height": 64}, headers=AUTH, timeout=120).json()
    assert again["images"] == [answer["images"][1]]
    # OpenAI's url answer is a gallery entry's file.
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    [item] = client.images.generate(prompt="a blue fox", size="64x64", response_format="url").data
    entry_id = item.url.split("/v1/gallery/")[1].split("/")[0]
    assert httpx.get(f"{url}/v1/gallery/{entry_id}", headers=AUTH).json()["recipe"]["prompt"] == "a blue fox"


def test_pin_delete_and_a_restarted_server_lists_the_same(served: tuple[str, Engine, Path]) -> None:
    url, engine, base = served
    made = httpx.post(f"{url}/v1/images/generate", json={"prompt": "kept", "count": 2, **SMALL}, headers=AUTH,
                      timeout=120).json()["gallery"]
    pinned = httpx.post(f"{url}/v1/gallery/{made[0]}/pin", json={"pinned": True}, headers=AUTH).json()
    assert pinned["pinned"] is True
    assert httpx.delete(f"{url}/v1/gallery/{made[1]}", headers=AUTH).json() == {"id": made[1], "deleted": True}
    missing = httpx.get(f"{url}/v1/gallery/{made[1]}/file", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "gallery_entry_not_found"
    before = httpx.get(f"{url}/v1/gallery", params={"limit": 200}, headers=AUTH).json()
    settings = ServerSettings(output_roots=(base / "outputs",), token=TOKEN)
    with LiveServer(create_app(Engine(runs_dir=base / "outputs"), settings)) as restarted:
        after = httpx.get(f"{restarted}/v1/gallery", params={"limit": 200}, headers=AUTH).json()
        assert after["data"] == before["data"] and after["total"] == before["total"]
        only = httpx.get(f"{restarted}/v1/gallery", params={"pinned": "true"}, headers=AUTH).json()
        assert made[0] in [e["id"] for e in only["data"]]
    bad = httpx.get(f"{url}/v1/gallery/..%2F..%2Frun.json", headers=AUTH)
    assert bad.status_code == 404


def test_a_server_without_outputs_keeps_no_gallery_and_refuses_url_answers_before_running(
        tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    with LiveServer(create_app(engine, ServerSettings(model_roots=(tiny_pipeline("sdxl").parent,)))) as url:
        listing = httpx.get(f"{url}/v1/gallery")
        assert listing.status_code == 409 and listing.json()["error"]["code"] == "no_gallery"
        asked = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "response_format": "url"})
        assert asked.status_code == 409 and asked.json()["error"]["code"] == "no_gallery"
