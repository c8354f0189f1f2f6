"""The small hostile inputs, each where it starts: a Host header that only looks like
loopback, a config file nested past any table, a run record naming no process."""

from __future__ import annotations

import json
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
