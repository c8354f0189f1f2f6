"""The other families split on two ranks: a FLUX.1 image by Ulysses, a HunyuanVideo 1.5 clip by
CFG (its guider runs each condition apart; diffusers has no context-parallel plan for it).

Beside ``test_split_requests.py`` (the Wan cases, a lost rank, a cancel): its own file so the
two spread over the suite's workers. The same comparison: fp32 and one thread each side.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine import Engine
from tests.service.test_split_requests import ONE, _clip, _image, _split

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Engine:
    with Engine(allow_download=False) as engine:
        yield engine


def test_a_flux_image_split_by_ulysses_equals_one_process(engine: Engine,
                                                          tiny_pipeline: Callable[..., Path]) -> None:
    flux = tiny_pipeline("flux")
    one = _image(engine, flux, ONE)
    assert np.array_equal(_image(engine, flux, _split("ulysses")), one)


def test_a_hunyuan_video_clip_split_by_cfg_equals_one_process(engine: Engine,
                                                              tiny_pipeline: Callable[..., Path]) -> None:
    folder = tiny_pipeline("hunyuan_video")
    assert np.array_equal(_clip(engine, folder, _split("cfg")), _clip(engine, folder, ONE))
