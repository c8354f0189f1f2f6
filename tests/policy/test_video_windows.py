"""A clip longer than a checkpoint's trained window: windows chained on the last frame, or a refusal.

Decided before anything loads (engine.policy.video_windows through the shape gate).
"""

from __future__ import annotations

import pytest

from engine.contract.plugins import load_registry
from engine.errors import EngineError
from engine.policy.video import video_shape

REGISTRY = load_registry()
WAN = REGISTRY.family("wan")
TI2V = WAN.checkpoint("wan2.2-ti2v-5b")


def test_past_the_trained_window_a_clip_renders_in_windows_of_that_window() -> None:
    shape = video_shape(WAN, TI2V, frames=361)
    assert shape.windows is not None and shape.windows.counts == (121, 121, 121)
    assert shape.frames == 361 and shape.call_frames == 121  # the memory plan is one window's
    assert shape.latent_frames == 31  # one window's latents, not the clip's
    assert "more than Wan 2.2 TI2V-5B's 121-frame trained window: 3 windows" in shape.windows.reason
    assert shape.to_dict()["windows"]["overlap"] == 1


def test_within_the_window_a_clip_is_one_call_and_asked_windows_tile_the_clip() -> None:
    assert video_shape(WAN, TI2V, frames=121).windows is None
    shape = video_shape(WAN, TI2V, frames=13, window=5, width=64, height=64)
    assert shape.windows is not None and shape.windows.counts == (5, 5, 5)  # 5 + 4 + 4 new frames
    last_short = video_shape(WAN, TI2V, frames=17, window=9, width=64, height=64)
    assert last_short.windows is not None and last_short.windows.counts == (9, 9)
    assert video_shape(WAN, TI2V, frames=21, window=9, width=64, height=64).windows.counts == (9, 9, 5)


@pytest.mark.parametrize(("family", "checkpoint", "frames", "window", "words"), [
    ("wan", "wan2.1-t2v-14b", 161, None, "has no image-to-video workflow to continue a clip"),
    ("ltx2", None, 1001, None, "its sound cannot be carried from one window to the next"),
    ("wan", "wan2.2-ti2v-5b", 13, 6, "window_frames=6: Wan 2.2 TI2V-5B renders windows of 4k+1 frames"),
    ("wan", "wan2.2-ti2v-5b", 14, 5, "frames=14"),  # off the lattice: the gate's own refusal
])
def test_a_long_clip_a_family_cannot_chain_is_refused_with_the_reason(
        family: str, checkpoint: str | None, frames: int, window: int | None, words: str) -> None:
    spec = REGISTRY.family(family)
    with pytest.raises(EngineError) as caught:
        video_shape(spec, spec.checkpoint(checkpoint) if checkpoint else None, frames=frames, window=window,
                    width=64 if window else None, height=64 if window else None)
    assert caught.value.code == "invalid_video_shape" and words in caught.value.message


def test_a_long_clip_is_planned_for_one_window() -> None:
    from engine import Engine
    from engine.requests.inference import InferenceRequest
    from engine.requests.machine import MachineRequest

    with Engine(hardware=MachineRequest(preset="rtx4090"), allow_download=False) as engine:
        long = engine.images.plan(family="wan", checkpoint="wan2.2-ti2v-5b", request=InferenceRequest(frames=361))
        window = engine.images.plan(family="wan", checkpoint="wan2.2-ti2v-5b", request=InferenceRequest(frames=121))
        assert long.estimate == window.estimate
        with pytest.raises(EngineError):  # the plan refuses what the generate would
            engine.images.plan(family="wan", checkpoint="wan2.1-t2v-14b", request=InferenceRequest(frames=161))
