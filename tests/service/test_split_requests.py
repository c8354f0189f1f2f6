"""One request on two ranks (two CPU processes over gloo, as two GPUs would run it).

Real ranks started by the engine, each loading the tiny pipeline folder and splitting its
denoiser through diffusers' context parallel (Ulysses, Ring) or the engine's CFG split,
compared with one process rendering the same request (fp32 and one thread each side, the
split's own plan: no step cache). CFG parallel moves whole outputs, so it is exact; a sequence
split (Ulysses, Ring: partial attentions merged by their log-sum-exp) is within a level of the
8-bit frames.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from engine import Engine
from engine.errors import Cancelled, EngineError
from engine.requests.bodies import GenerateBody
from engine.requests.inference import InferenceRequest
from engine.service.ranks import rank_pids

pytestmark = pytest.mark.slow

ONE = InferenceRequest(threads=1, step_cache="off", dtype="fp32")
#: What a sequence split's reordered sums may move an 8-bit value by, in fp32 (measured: 1 level, on
#: a handful of values; the tiny FLUX's Ulysses image is exact). In bf16 either split moves values by
#: a few levels, as one thread against two does: bf16 rounding follows the kernel's blocking.
SEQUENCE_LEVELS = 1


def _descendants() -> set[int]:
    """The PIDs of this process's living descendants (the fork server, its ranks and trainers...)."""
    alive = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.add(process.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def _split(kind: str) -> InferenceRequest:
    return InferenceRequest(threads=1, gpus=2, parallel=kind, dtype="fp32")


def _clip(engine: Engine, folder: Path, request: InferenceRequest, steps: int = 3, **kwargs: Any) -> np.ndarray:
    body = GenerateBody(prompt="a fox in snow", model=str(folder), seed=5, steps=steps, width=64, height=64, frames=5)
    ticket = engine.videos.check_generate(body, request=request)
    video = engine.videos.generate(ticket, **kwargs)
    if request.gpus:  # the ranks say what they split: the comparison is not one process against itself
        assert video.recipe["parallel"]["split"] == ["transformer"]
        assert video.recipe["parallel"]["label"] == ticket.plan.parallel.label
    return np.stack([np.asarray(frame, dtype=np.int16) for frame in video.frames])


def _image(engine: Engine, folder: Path, request: InferenceRequest) -> np.ndarray:
    body = GenerateBody(prompt="a fox in snow", model=str(folder), seed=5, steps=3, width=64, height=64)
    ticket = engine.images.check_generate(body, request=request)
    return np.asarray(engine.images.generate(ticket)[0], dtype=np.int16)


@pytest.fixture(scope="module")
def engine() -> Engine:
    with Engine(allow_download=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def wan(tiny_pipeline: Callable[..., Path]) -> Path:
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def wan_one(engine: Engine, wan: Path) -> np.ndarray:
    return _clip(engine, wan, ONE)


@pytest.mark.parametrize(("kind", "levels"), [("ulysses", SEQUENCE_LEVELS), ("ring", SEQUENCE_LEVELS)])
def test_a_wan_clip_split_by_its_sequence_equals_one_process(engine: Engine, wan: Path, wan_one: np.ndarray,
                                                             kind: str, levels: int) -> None:
    ticket = engine.videos.check_generate(GenerateBody(prompt="x", model=str(wan)), request=_split(kind))
    assert ticket.plan.parallel.sequence == 2 and ticket.plan.parallel.cfg == 1
    split = _clip(engine, wan, _split(kind))
    assert split.shape == wan_one.shape
    assert np.abs(split - wan_one).max() <= levels


def test_a_rank_lost_mid_clip_fails_the_job_and_the_next_job_runs_cfg_split(
        engine: Engine, wan: Path, wan_one: np.ndarray) -> None:
    killed: list[int] = []
    seen: set[int] = set()

    def kill_rank_one(step: int, total: int) -> None:
        seen.update(rank_pids().values())
        if not killed:
            pid = rank_pids()[1]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with pytest.raises(EngineError) as caught:  # 30 steps: rank 1 cannot be done by the time the
        # engine reads rank 0's first progress, however loaded the machine (it keeps step with rank 0)
        _clip(engine, wan, _split("cfg"), steps=30, progress=kill_rank_one)
    assert caught.value.code == "rank_lost"
    assert f"rank 1 of 2 (pid {killed[0]}) was killed by signal 9 (SIGKILL)" in caught.value.message
    assert len(seen) == 2 and not seen & _descendants() and not rank_pids()  # the other rank was stopped too
    # the engine lives on: the next job starts fresh ranks, condition and uncondition one each
    assert np.array_equal(_clip(engine, wan, _split("cfg")), wan_one)


def test_a_split_the_family_cannot_take_is_refused_before_any_rank_starts_or_anything_is_evicted(
        engine: Engine, wan: Path, tiny_pipeline: Callable[..., Path]) -> None:
    """The 0-eviction row of ``gpus``: the loaded model stays, no rank starts."""
    engine.images.load(str(wan), request=ONE)
    before, processes = engine.images.status(), _descendants()
    sdxl = str(tiny_pipeline("sdxl"))
    for attempt in (lambda: engine.images.check_generate(GenerateBody(prompt="x", model=sdxl),
                                                         request=InferenceRequest(gpus=2)),
                    lambda: engine.images.load(sdxl, request=InferenceRequest(gpus=2)),
                    lambda: engine.videos.check_generate(GenerateBody(prompt="x", model=str(wan)),
                                                         request=InferenceRequest(gpus=64))):
        with pytest.raises(EngineError) as caught:
            attempt()
        assert caught.value.code == "parallel_unsupported"
    after = engine.images.status()
    assert after is not None and before is not None and after["model"]["location"] == str(wan)
    assert after["model"] == before["model"]
    assert _descendants() == processes  # no rank started


def test_python_callers_split_a_long_clip_with_keywords_each_window_on_its_ranks_and_a_cancel_stops_them(
        engine: Engine, wan: Path) -> None:
    """``engine.videos.generate(..., gpus=2, parallel=...)``: the split a checked request would get;
    a clip of two windows runs each window on fresh ranks, progress over the whole clip; a cancel
    in the second window stops its ranks (none left) and the clip."""
    cancel = threading.Event()
    steps: list[tuple[int, int]] = []
    seen: set[int] = set()

    def stop_in_the_second_window(step: int, total: int) -> None:
        steps.append((step, total))
        seen.update(rank_pids().values())
        if step > total // 2:
            cancel.set()

    with pytest.raises(Cancelled):
        engine.videos.generate("a fox in snow", model=str(wan), seed=5, steps=3, width=64, height=64, frames=9,
                               window_frames=5, gpus=2, parallel="cfg", cancel=cancel,
                               progress=stop_in_the_second_window)
    assert steps[:3] == [(1, 6), (2, 6), (3, 6)] and steps[3] == (4, 6)  # the first window whole, on its ranks
    assert len(seen) == 4 and not seen & _descendants()  # two ranks a window; the second's were stopped
    with pytest.raises(EngineError) as caught:
        engine.videos.generate("a fox", model=str(wan), gpus="two")
    assert caught.value.code == "invalid_request" and "gpus" in caught.value.message
