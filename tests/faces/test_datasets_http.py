"""The dataset manager over HTTP (``/v1/datasets``): a real server on loopback with a
token, real files in a dataset root, and what the trainer then reads from them.

What it promises: captions in the trainer's precedence (``metadata.jsonl`` before a
``.txt`` beside the image), edits written where the trainer reads them, uploads
checked whole (a name already there, a traversal, a corrupt file refuse the upload
and change nothing), deletes that take the caption along, and 409
``dataset_in_use`` for every change while a run trains on the dataset.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from engine import Engine
from engine.hardware.presets import preset
from engine.preflight.dataset import discover_dataset
from engine.server.app import ServerSettings, create_app
from engine.testing.datasets import write_dataset
from tests.support import LiveServer

TOKEN = "datasets-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Site:
    url: str
    root: Path
    runs: Path
    engine: Engine


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    root, runs = tmp_path / "datasets", tmp_path / "runs"
    shapes = write_dataset(root / "shapes", count=3, size=64)
    # image_000 is captioned twice: metadata.jsonl wins over its .txt, as in training.
    (shapes / "metadata.jsonl").write_text(json.dumps({"file_name": "image_000.png", "text": "from metadata"}) + "\n",
                                           encoding="utf-8")
    (shapes / "image_002.txt").unlink()
    engine = Engine(hardware=preset("cpu"), runs_dir=runs)
    settings = ServerSettings(dataset_roots=(root,), output_roots=(runs,), token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        yield Site(url, root, runs, engine)


def png(width: int = 40, height: int = 30, colour: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "PNG")
    return out.getvalue()


def call(site: Site, method: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.request(method, f"{site.url}/v1/datasets{path}", headers=AUTH, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_datasets_list_with_captions_in_the_trainers_precedence_and_thumbnails(site: Site) -> None:
    assert httpx.get(f"{site.url}/v1/datasets").status_code == 401  # the token, as everywhere
    [listed] = call(site, "GET", "").json()
    assert (listed["name"], listed["images"], listed["captioned"], listed["in_use_by"]) == ("shapes", 3, 2, None)
    shown = {i["image"]: i for i in call(site, "GET", "/shapes").json()["images"]}
    assert (shown["image_000.png"]["caption"], shown["image_000.png"]["caption_source"]) == ("from metadata", "metadata.jsonl")
    assert shown["image_001.png"]["caption_source"] == "image_001.txt" and shown["image_001.png"]["width"] == 64
    assert (shown["image_002.png"]["caption"], shown["image_002.png"]["caption_source"]) == ("", None)
    trainer = {item.relative: item.caption for item in discover_dataset(site.root / "shapes").items}
    assert {name: entry["caption"] for name, entry in shown.items()} == trainer  # what a run would train with
    thumbnail = call(site, "GET", "/shapes/thumbnails/image_001.png", params={"size": 32})
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(thumbnail.content)).size == (32, 32)
    assert call(site, "GET", "/nope").json()["error"]["code"] == "dataset_not_found"
    assert call(site, "GET", "/shapes/thumbnails/missing.png").status_code == 404


def test_captions_are_edited_and_cleared_where_the_trainer_reads_them(site: Site) -> None:
    folder = site.root / "shapes"
    edited = call(site, "PUT", "/shapes/captions/image_000.png", json={"caption": "a circle, edited"})
    assert edited.status_code == 200 and edited.json()["caption_source"] == "metadata.jsonl"
    assert json.loads((folder / "metadata.jsonl").read_text(encoding="utf-8"))["text"] == "a circle, edited"
    assert call(site, "PUT", "/shapes/captions/image_002.png", json={"caption": "new words"}).json()["caption_source"] == "image_002.txt"
    assert (folder / "image_002.txt").read_text(encoding="utf-8").strip() == "new words"
    cleared = call(site, "PUT", "/shapes/captions/image_001.png", json={"caption": ""}).json()
    assert cleared["caption"] == "" and not (folder / "image_001.txt").exists()
    trainer = {item.relative: item.caption for item in discover_dataset(folder).items}
    assert trainer == {"image_000.png": "a circle, edited", "image_001.png": "", "image_002.png": "new words"}
    assert call(site, "PUT", "/shapes/captions/nope.png", json={"caption": "x"}).json()["error"]["code"] == "image_not_found"
    assert call(site, "PUT", "/shapes/captions/image_001.png", json={"caption": 3}).status_code == 422


def test_uploads_are_checked_whole_for_collisions_traversal_and_corrupt_files(site: Site) -> None:
    folder = site.root / "shapes"
    before = sorted(p.name for p in folder.iterdir())
    refusals = {
        "image_exists": [("files", ("image_001.png", png(), "image/png"))],
        "path_outside_roots": [("files", ("../escape.png", png(), "image/png"))],
        "invalid_image": [("files", ("fine.png", png(), "image/png")), ("files", ("bad.png", b"not a png", "image/png"))],
    }
    for code, files in refusals.items():
        refused = call(site, "POST", "/shapes/images", files=files)
        assert refused.json()["error"]["code"] == code, refused.text
        assert refused.status_code == (409 if code == "image_exists" else 400)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing of a refused upload stays
    assert not (site.root / "escape.png").exists()
    assert call(site, "POST", "/..%2Fup/images", files=[("files", ("a.png", png(), "image/png"))]).status_code in (400, 404)
    added = call(site, "POST", "/fresh/images", files=[("files", ("a.png", png(), "image/png")),
                                                         ("files", ("b.png", png(colour="blue"), "image/png"))])
    assert added.status_code == 201 and added.json() == {"name": "fresh", "added": ["a.png", "b.png"], "count": 2}
    assert {d["name"] for d in call(site, "GET", "").json()} == {"shapes", "fresh"}
    assert [i.relative for i in discover_dataset(site.root / "fresh").items] == ["a.png", "b.png"]


def test_deleting_an_image_takes_its_caption_and_metadata_line_along(site: Site) -> None:
    folder = site.root / "shapes"
    (folder / "image_000.txt").write_text("the shadowed sidecar\n", encoding="utf-8")
    assert call(site, "DELETE", "/shapes/images/image_000.png").json()["count"] == 2
    assert not (folder / "image_000.png").exists() and not (folder / "image_000.txt").exists()
    assert (folder / "metadata.jsonl").read_text(encoding="utf-8").strip() == ""
    assert call(site, "DELETE", "/shapes/images/..%2F..%2Fetc%2Fpasswd").status_code in (400, 404)
    assert call(site, "DELETE", "/shapes/images/image_000.png").json()["error"]["code"] == "image_not_found"


def test_a_dataset_a_run_in_another_process_is_using_refuses_every_change_with_409(site: Site) -> None:
    """What a `train` in another terminal leaves in the shared runs folder: its record,
    running, owned by a live process (this one stands in for it)."""
    from engine.training.lock import ProcessId
    from engine.training.records import RunRecord

    live = ProcessId.current()
    record = RunRecord(run_id="other-terminal", folder=site.runs / "other-terminal", family="sdxl", base_model="b",
                       config={"dataset_dir": str(site.root / "shapes")}, plan={}, status="running", steps=100,
                       owner_pid=live.pid, owner_started=live.started)
    record.folder.mkdir(parents=True)
    record.save()
    assert call(site, "GET", "").json()[0]["in_use_by"] == "other-terminal"
    changes = [("PUT", "/shapes/captions/image_001.png", {"json": {"caption": "x"}}),
               ("DELETE", "/shapes/images/image_001.png", {}),
               ("POST", "/shapes/images", {"files": [("files", ("new.png", png(), "image/png"))]})]
    for method, path, kwargs in changes:
        refused = call(site, method, path, **kwargs)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "dataset_in_use", path
        assert "other-terminal" in refused.json()["error"]["message"]
    assert (site.root / "shapes" / "image_001.txt").read_text(encoding="utf-8").strip()
    record.status = "completed"
    record.save()
    assert call(site, "PUT", "/shapes/captions/image_001.png", json={"caption": "x"}).status_code == 200


def test_an_upload_over_the_upload_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    engine = Engine(hardware=preset("cpu"), runs_dir=tmp_path / "runs")
    settings = ServerSettings(dataset_roots=(tmp_path / "datasets",), token=TOKEN, max_upload_bytes=2000)
    with LiveServer(create_app(engine, settings)) as url:
        big = httpx.post(f"{url}/v1/datasets/d/images", headers=AUTH,
                         files=[("files", ("big.png", png(400, 400, "green") + os.urandom(4000), "image/png"))])
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert not (tmp_path / "datasets" / "d").exists()


def test_a_dataset_name_that_is_a_symlink_file_or_dangling_link_is_refused(site: Site, tmp_path: Path) -> None:
    """An upload into ``root/name`` never writes through a symlink to outside the roots, and a
    name that is a plain file or a dangling link is a 4xx, never a 500."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (site.root / "escape").symlink_to(outside)
    (site.root / "dangling").symlink_to(tmp_path / "gone")
    (site.root / "plain").write_text("not a folder", encoding="utf-8")
    for name in ("escape", "dangling", "plain"):
        response = call(site, "POST", f"/{name}/images", files=[("files", ("new.png", png(), "image/png"))])
        assert response.status_code == 400 and response.json()["error"]["code"] == "path_outside_roots", response.text
    assert list(outside.iterdir()) == []
    assert (site.root / "plain").read_text(encoding="utf-8") == "not a folder"


def test_an_overlong_file_name_is_a_4xx(site: Site) -> None:
    long = "a" * 300 + ".png"
    response = call(site, "POST", "/shapes/images", files=[("files", (long, png(), "image/png"))])
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request", response.text
    for method, path in (("GET", f"/shapes/thumbnails/{long}"), ("DELETE", f"/shapes/images/{long}")):
        response = call(site, method, path)
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request", response.text


def test_a_refused_delete_removes_nothing(site: Site, tmp_path: Path) -> None:
    """A caption sidecar that is a symlink leading out refuses the delete before the image goes."""
    secret = tmp_path / "secret.txt"
    secret.write_text("keep", encoding="utf-8")
    (site.root / "shapes" / "image_002.txt").symlink_to(secret)
    response = call(site, "DELETE", "/shapes/images/image_002.png")
    assert response.status_code == 400 and response.json()["error"]["code"] == "path_outside_roots", response.text
    assert (site.root / "shapes" / "image_002.png").is_file() and secret.read_text(encoding="utf-8") == "keep"


def test_thumbnails_decode_once_and_take_the_input_header_cap(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.service.dataset_library as library

    decoded: list[Path] = []
    real = library.decode_image
    monkeypatch.setattr(library, "decode_image", lambda path, cap: decoded.append(path) or real(path, cap))
    for _ in range(3):
        assert call(site, "GET", "/shapes/thumbnails/image_001.png", params={"size": 48}).status_code == 200
    assert len(decoded) == 1  # kept after the first
    from engine.preflight.images import MAX_INPUT_PIXELS

    assert library.DatasetLibrary((site.root,), lambda _: None).max_pixels == MAX_INPUT_PIXELS


def test_clips_are_uploaded_checked_listed_and_thumbnailed_by_their_first_frame(site: Site, tmp_path: Path) -> None:
    from engine.testing.datasets import write_clip

    clip = write_clip(tmp_path / "slide.mp4", frames=9, size=(64, 48)).read_bytes()
    refused = call(site, "POST", "/moving/images", files=[("files", ("ok.mp4", clip, "video/mp4")),
                                                          ("files", ("cut.mp4", clip[:200], "video/mp4"))])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_image"
    assert "cut.mp4" in refused.json()["error"]["message"] and not (site.root / "moving" / "ok.mp4").exists()
    added = call(site, "POST", "/moving/images", files=[("files", ("slide.mp4", clip, "video/mp4")),
                                                        ("files", ("still.png", png(), "image/png"))])
    assert added.status_code == 201 and added.json()["count"] == 2
    shown = {i["image"]: i for i in call(site, "GET", "/moving").json()["images"]}
    assert (shown["slide.mp4"]["kind"], shown["slide.mp4"]["width"], shown["slide.mp4"]["height"]) == ("clip", 64, 48)
    assert shown["slide.mp4"]["seconds"] == pytest.approx(9 / 16, abs=0.07) and shown["still.png"]["kind"] == "image"
    thumbnail = call(site, "GET", "/moving/thumbnails/slide.mp4", params={"size": 32})
    assert thumbnail.status_code == 200
    first = Image.open(io.BytesIO(thumbnail.content)).convert("RGB")
    assert first.size == (32, 24)
    # The first frame's square sits at the left edge (it slides right in later frames).
    assert first.getpixel((4, 12))[0] > 200 and first.getpixel((28, 12))[0] < 200
    report = discover_dataset(site.root / "moving")
    assert {item.relative: item.is_clip for item in report.items} == {"slide.mp4": True, "still.png": False}
