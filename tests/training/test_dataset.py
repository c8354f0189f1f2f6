"""Dataset discovery: captions from sidecars and metadata.jsonl, every image decoded up front."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from engine.preflight.dataset import DatasetError, discover_dataset
from engine.testing.datasets import write_dataset


def test_sidecar_captions_and_skipped_files_are_reported(tmp_path: Path) -> None:
    write_dataset(tmp_path, count=3)
    (tmp_path / "notes.md").write_text("not data", encoding="utf-8")
    (tmp_path / "image_001.txt").unlink()
    report = discover_dataset(tmp_path)
    assert [i.relative for i in report.items] == ["image_000.png", "image_001.png", "image_002.png"]
    assert report.items[0].caption == "a red circle on a blue background"
    assert report.uncaptioned == ("image_001.png",) and report.items[1].caption == ""
    assert report.skipped == (("notes.md", "not an image or a clip (.md)"),)


def test_caption_file_and_nested_metadata_keys_match_as_posix_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "sub" / "a.jpg")
    Image.new("RGB", (8, 8)).save(tmp_path / "b.webp")
    (tmp_path / "b.caption").write_text("from a .caption file\n", encoding="utf-8")
    (tmp_path / "metadata.jsonl").write_text(
        json.dumps({"file_name": "sub\\a.jpg", "text": "über caption, windows path"}) + "\n", encoding="utf-8"
    )
    report = discover_dataset(tmp_path)
    captions = {i.relative: i.caption for i in report.items}
    assert captions == {"b.webp": "from a .caption file", "sub/a.jpg": "über caption, windows path"}


def test_exif_rotation_is_applied_before_sizing(tmp_path: Path) -> None:
    image = Image.new("RGB", (40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    image.save(tmp_path / "rotated.jpg", exif=exif)
    [item] = discover_dataset(tmp_path).items
    assert item.size == (20, 40)


def test_every_bad_file_is_listed_in_one_error(tmp_path: Path) -> None:
    write_dataset(tmp_path, count=2)
    (tmp_path / "empty.png").write_bytes(b"")
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buffer, format="PNG")
    (tmp_path / "truncated.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (tmp_path / "fake.jpg").write_text("this is not a jpeg", encoding="utf-8")
    with pytest.raises(DatasetError) as raised:
        discover_dataset(tmp_path)
    error = raised.value
    assert error.code == "bad_dataset"
    reasons = dict(error.problems)
    assert set(reasons) == {"empty.png", "truncated.png", "fake.jpg"}
    assert "0 bytes" in reasons["empty.png"] and "not an image" in reasons["fake.jpg"]
    assert "3 of 5 files" in error.message


def test_decompression_bomb_is_refused(tmp_path: Path) -> None:
    Image.new("1", (400, 300)).save(tmp_path / "bomb.png")
    with pytest.raises(DatasetError) as raised:
        discover_dataset(tmp_path, max_pixels=100_000)
    assert "decompression bomb" in dict(raised.value.problems)["bomb.png"]


def test_missing_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as raised:
        discover_dataset(tmp_path / "nope")
    assert raised.value.code == "dataset_not_found"
    with pytest.raises(DatasetError) as raised:
        discover_dataset(tmp_path)
    assert raised.value.code == "empty_dataset"


def test_malformed_metadata_lines_are_refused(tmp_path: Path) -> None:
    write_dataset(tmp_path, count=1)
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "image_000.png"}\nnot json\n', encoding="utf-8")
    with pytest.raises(DatasetError) as raised:
        discover_dataset(tmp_path)
    assert [line for line, _ in raised.value.problems] == ["metadata.jsonl:1", "metadata.jsonl:2"]


def report_folder(folder: Path) -> Path:
    """Two identical images (one with an empty metadata caption), one 20x20 image, a caption for a gone file."""
    write_dataset(folder, count=2)
    (folder / "copy.png").write_bytes((folder / "image_000.png").read_bytes())
    (folder / "copy.txt").write_text("the same pixels under another name", encoding="utf-8")
    Image.new("RGB", (20, 20), (9, 9, 9)).save(folder / "tiny.png")
    (folder / "tiny.txt").write_text("a tiny image", encoding="utf-8")
    (folder / "metadata.jsonl").write_text(
        json.dumps({"file_name": "image_001.png", "text": "   "}) + "\n"
        + json.dumps({"file_name": "gone/photo.jpg", "text": "a photo that was deleted"}) + "\n",
        encoding="utf-8",
    )
    return folder


def test_the_report_names_empty_captions_small_images_duplicates_and_captions_for_missing_images(
    tmp_path: Path,
) -> None:
    report = discover_dataset(report_folder(tmp_path), resolution=64)
    assert report.uncaptioned == ("image_001.png",)  # an empty caption is no caption
    assert report.small == (("tiny.png", "20x20"),)
    assert report.duplicates == (("copy.png", "image_000.png"),)
    assert report.missing_images == ("gone/photo.jpg",)
    warnings = "\n".join(report.to_dict()["warnings"])  # type: ignore[arg-type]
    for named in ("image_001.png", "tiny.png (20x20)", "copy.png, image_000.png", "gone/photo.jpg"):
        assert named in warnings
    assert discover_dataset(tmp_path).small == ()  # sizes are judged only against a resolution


def test_strict_refuses_small_images_naming_them(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as raised:
        discover_dataset(report_folder(tmp_path), resolution=64, strict=True)
    assert raised.value.code == "small_images" and dict(raised.value.problems).keys() == {"tiny.png"}
    assert "--strict" in raised.value.message and "lower resolution" in raised.value.message
    assert discover_dataset(tmp_path, resolution=32, strict=True).small == ()


def test_the_dry_run_plan_carries_the_dataset_report_and_strict_refuses_before_eviction(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    from engine import Engine
    from engine.errors import EngineError
    from engine.hardware.presets import PRESETS
    from engine.contract.plugins import load_registry
    from tests.support import HostModel

    engine = Engine(registry=load_registry(), hardware=PRESETS["h100"], runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    config = {"base_model": str(tiny_pipeline("zimage")), "dataset_dir": str(report_folder(tmp_path / "data")),
              "resolution": 64}
    plan = engine.training.plan(config).to_dict()
    assert plan["dataset"]["small"] == [{"file": "tiny.png", "size": "20x20"}]
    assert plan["dataset"]["missing_images"] == ["gone/photo.jpg"]
    assert [(b["width"], b["height"], b["images"]) for b in plan["buckets"]["buckets"]] == [(64, 64, 4)]
    with pytest.raises(EngineError) as raised:
        engine.training.start({**config, "strict": True})
    assert raised.value.code == "small_images"
    assert host.evicted == 0 and engine.residency.owner is None
