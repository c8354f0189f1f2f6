"""A clip three windows long, rendered on the tiny Wan window by window (engine.videos).

Each window after the first continues from the last frame so far (image to video), that
frame blended across the seam. Random weights make every frame-to-frame step large, so the
seams are judged against the clip's own steps: no seam steps further than the clip does
within a window, where three windows rendered apart (no last frame to continue from) do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine import Engine
from engine.errors import Cancelled
from engine.requests.bodies import GenerateBody

pytestmark = pytest.mark.slow

#: Three windows of 5 frames: 5 + 4 + 4 new frames.
FRAMES, WINDOW = 13, 5
#: The steps that cross a seam (into and out of each blended frame: frames 4 and 8).
SEAMS = (3, 4, 7, 8)


def _body(folder: Path, **fields: object) -> GenerateBody:
    return GenerateBody(**{"prompt": "a fox in snow", "model": str(folder), "seed": 3, "steps": 3, "width": 64,
                           "height": 64, **fields})


def _steps(frames: np.ndarray) -> np.ndarray:
    return np.abs(np.diff(frames.astype(np.float32), axis=0)).mean(axis=(1, 2, 3))


@pytest.fixture(scope="module")
def engine() -> Engine:
    with Engine(allow_download=False) as engine:
        yield engine


def test_three_windows_run_on_without_a_cut_with_progress_over_the_whole_clip(
        engine: Engine, tiny_pipeline: Callable[..., Path]) -> None:
    folder = tiny_pipeline("wan")
    said: list[tuple[int, int]] = []
    ticket = engine.videos.check_generate(_body(folder, frames=FRAMES, window_frames=WINDOW))
    assert ticket.shape is not None and ticket.shape.windows is not None
    assert ticket.shape.windows.counts == (5, 5, 5) and ticket.plan.controls  # planned at one window
    video = engine.videos.generate(ticket, progress=lambda step, total: said.append((step, total)))
    assert len(video.frames) == FRAMES and video.recipe["windows"]["windows"] == [5, 5, 5]
    assert said == [(step, 9) for step in range(1, 10)]  # 3 windows x 3 steps, one count
    steps = _steps(np.stack([np.asarray(frame) for frame in video.frames]))
    inside = np.delete(steps, SEAMS)
    assert steps[list(SEAMS)].max() <= inside.max()
    # the control: the same three windows rendered apart cut at each seam
    apart = [np.stack([np.asarray(f) for f in engine.videos.generate(_body(folder, frames=WINDOW, seed=3 + i)).frames])
             for i in range(3)]
    cuts = _steps(np.concatenate(apart))[[4, 9]]
    assert cuts.min() > steps[list(SEAMS)].max()


def test_a_cancel_stops_the_clip_between_windows_or_steps(engine: Engine,
                                                          tiny_pipeline: Callable[..., Path]) -> None:
    cancel = threading.Event()
    seen: list[int] = []

    def stop_in_the_second_window(step: int, total: int) -> None:
        seen.append(step)
        if step == 4:
            cancel.set()

    with pytest.raises(Cancelled):
        engine.videos.generate(_body(tiny_pipeline("wan"), frames=FRAMES, window_frames=WINDOW),
                               progress=stop_in_the_second_window, cancel=cancel)
    assert max(seen) < 9
