"""The small hostile inputs, each where it starts: a Host header that only looks like
loopback, a config file nested past any table, a run record naming no process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.server.guard import _hostname
from engine.training.records import RunRecord


@pytest.mark.parametrize(("header", "host"), [
    (b"[::1]:8000", "::1"), (b"[::1]", "::1"), (b"127.0.0.1:8000", "127.0.0.1"), (b"LOCALHOST", "localhost"),
])
def test_the_host_parser_reads_real_hosts(header: bytes, host: str) -> None:
    assert _hostname(header) == host


@pytest.mark.parametrize("header", [b"[::1]evil:8000", b"[::1]evil.example", b"[::1]:80:80"])
def test_a_bracketed_host_with_anything_after_it_is_not_loopback(header: bytes) -> None:
    assert _hostname(header) not in ("::1", "127.0.0.1", "localhost")


def test_a_config_file_nested_past_any_table_is_refused_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli import main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    status = main(["train", "--config", str(deep), "--dry-run"])
    err = capsys.readouterr().err
    assert status == 2 and "error[invalid_config]" in err and "nests too deep" in err and "Traceback" not in err, err


def test_a_running_record_that_names_no_process_reads_failed(tmp_path: Path) -> None:
    """It blocked its dataset and its own deletion for ever: nothing alive can be behind it."""
    folder = tmp_path / "run"
    RunRecord(run_id="run", folder=folder, family="sdxl", base_model="x", config={}, plan={},
              status="running").save()
    data = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    assert data["owner_pid"] is None and data["pid"] is None
    record = RunRecord.load(folder / "run.json")
    assert record.status == "failed" and record.error is not None and record.error["code"] == "trainer_gone"


def test_kept_outputs_past_the_galleries_age_go_and_are_removed(tmp_path: Path) -> None:
    """Images kept for response_format=url were never removed: now every output lives in the
    gallery, and one older than --gallery-max-age is a 404 and gone from the disk once the
    gallery sweeps (a real server on loopback serves the rest)."""
    import io

    import httpx
    from PIL import Image

    from engine import Engine
    from engine.server.app import create_app
    from engine.server.settings import ServerSettings
    from tests.support import LiveServer

    png = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(png, format="PNG")
    engine = Engine(runs_dir=tmp_path / "outputs")
    gallery = engine.open_gallery(tmp_path / "outputs" / "gallery")
    old, fresh = (gallery.add("image", png.getvalue(), recipe={}, width=8, height=8) for _ in range(2))
    os.utime(gallery.folder / f"{old.id}.png", (old.created - 3600,) * 2)  # its age is its file's
    settings = ServerSettings(output_roots=(tmp_path / "outputs",), gallery_max_age_s=60)
    with LiveServer(create_app(engine, settings)) as url:
        gone = httpx.get(f"{url}/v1/images/files/{old.id}.png")  # an earlier URL answer's name
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "gallery_entry_not_found"
        listed = httpx.get(f"{url}/v1/gallery").json()
        assert [entry["id"] for entry in listed["data"]] == [fresh.id] and listed["max_age_s"] == 60
        served = httpx.get(f"{url}/v1/gallery/{fresh.id}/file")
        assert served.status_code == 200 and served.content == png.getvalue()
    assert sorted(p.name for p in gallery.folder.iterdir()) == [f"{fresh.id}.json", f"{fresh.id}.png"]


@pytest.mark.parametrize("seconds", ["0", "-1", "inf"])
def test_a_gallery_bound_that_is_not_positive_is_refused_under_either_name(
    seconds: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    from engine.cli import main

    assert main(["serve", "--keep-url-images", seconds, "--port", "0", "--outputs", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "warning[deprecated]: --keep-url-images is deprecated and will be removed in 0.3.0; use --gallery-max-age" \
        in err, err
    assert "error[invalid_config]: --gallery-max-age must be a positive number" in err, err
    assert main(["serve", "--gallery-max-gb", seconds, "--port", "0", "--outputs", str(tmp_path / "o")]) == 2
    assert "error[invalid_config]: --gallery-max-gb" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "code", "says"), [
    (["--gpus", "64"], "not_enough_cores", "has 2 cores" if __import__("os").cpu_count() == 2 else "core"),
    (["--output", "/proc/1/nope"], "output_not_writable", "/proc/1"),
    (["--output", "{file}/run"], "output_not_writable", "making a folder"),
])
def test_a_dry_run_refuses_what_the_run_could_not_do(
    flags: list[str], code: str, says: str, tiny_pipeline: object, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Each passed --dry-run and failed later (64 CPU processes on 2 cores, a folder no one can write)."""
    from engine.cli import main
    from engine.testing.datasets import write_dataset

    data = write_dataset(tmp_path / "data", count=2)
    (tmp_path / "file").write_text("a file, not a folder")
    flags = [f.replace("{file}", str(tmp_path / "file")) for f in flags]
    status = main(["train", "--base", str(tiny_pipeline("flux")), "--data", str(data), "--dry-run",  # type: ignore[operator]
                   "--device", "cpu", "--resolution", "64", "--runs-dir", str(tmp_path / "runs"), *flags])
    err = capsys.readouterr().err
    assert status == 2 and f"error[{code}]" in err and says in err and "Traceback" not in err, err
