"""tests/leftovers.py: a test that fails while its trainer runs leaves no trainer running."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.testing.datasets import write_dataset
from tests.leftovers import running_trainers, stop

pytest_plugins = ["pytester"]

INNER = """
import time
from engine import Engine

def test_a_resume_that_regresses():
    # a runs folder per run: the killed trainer's lock may outlive its stop by a moment under load
    engine = Engine(runs_dir={runs!r} + "/" + str(time.time_ns()))
    engine.training.start({{"base_model": {base!r}, "dataset_dir": {data!r}, "resolution": 64,
                           "steps": 100000, "lora_rank": 2, "device": "cpu"}})
    assert engine.training.status()["status"] in ("starting", "running")
    assert False, "the regression: this test never reaches its wait or cancel"
"""


def test_a_failed_test_leaves_no_trainer_training(
    pytester: pytest.Pytester, tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    data = write_dataset(tmp_path / "data", count=2)
    pytester.makepyfile(test_inner=INNER.format(runs=str(tmp_path / "runs"), base=str(tiny_pipeline("sdxl")),
                                                data=str(data)))
    before = set(running_trainers())
    # Without the plugin (the suite before it), the failed test's trainer goes on training.
    bare = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:tests.leftovers")
    bare.assert_outcomes(failed=1)
    left = [p for pid, p in running_trainers().items() if pid not in before]
    try:
        assert len(left) == 1
    finally:
        stop(left)
    # The bare run's Engine lives on in this process: its watcher sees the stopped trainer
    # within a poll and gives the GPU back; the guarded run's Engine waits for that, as an
    # app's second Engine would (until then it is refused Busy, which is right).
    for watcher in [t for t in threading.enumerate() if t.name == "engine-run-watch"]:
        watcher.join(timeout=30)
        assert not watcher.is_alive()
    # With it, the test still fails as it should, and its trainer is stopped and named.
    guarded = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "tests.leftovers", "-rA")
    guarded.assert_outcomes(failed=1)
    assert [pid for pid in running_trainers() if pid not in before] == []
    guarded.stdout.fnmatch_lines(["*stopped trainer processes left running: [[]*[]]*"])
