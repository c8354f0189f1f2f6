"""The hunyuan_video plugin: the contract (its video run included), its guider's guidance,
and progress and cancel on a pipeline whose call takes no step callback."""

import threading
from pathlib import Path

import pytest

from engine.contract.plugins import Registry
from engine.policy.video import video_shape
from engine.testing import FamilyContract


class TestHunyuanVideoContract(FamilyContract):
    family_name = "hunyuan_video"


def test_480p_and_720p_have_their_presets(engine_registry: Registry) -> None:
    family = engine_registry.family("hunyuanvideo")
    p480 = family.checkpoint("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v")
    p720 = family.checkpoint("/models/HunyuanVideo-1.5-720p")
    assert family.video_of(p480).presets[0] == (832, 480) and family.video_of(p720).presets[0] == (1280, 720)
    shape = video_shape(family, p480)
    # 16x VAE, 1x1 patches: one token per 16 px; 121 frames are 31 latent frames.
    assert (shape.frames, shape.fps, shape.latent_frames, shape.tokens) == (121, 24, 31, 31 * 52 * 30)


@pytest.mark.slow
def test_guidance_reaches_the_guider_and_progress_and_cancel_follow_the_steps(
    engine_registry: Registry, tmp_path: Path,
) -> None:
    from engine.errors import Cancelled
    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    folder = engine_registry.build_tiny_pipeline(engine_registry.family("hunyuan_video"), tmp_path / "hv")
    engine = Engine(registry=engine_registry, hardware=probe(verify=False))
    engine.images.load(str(folder))
    steps: list[tuple[int, int]] = []
    clip = engine.videos.generate("a fox", frames=5, width=64, height=64, steps=2, guidance=3.5, seed=1,
                                  progress=lambda done, total: steps.append((done, total)))
    assert len(clip.frames) == 5
    assert engine.images.session.pipeline.guider.guidance_scale == 3.5  # type: ignore[union-attr]
    assert steps == [(1, 2), (2, 2)]
    cancel = threading.Event()
    reported: list[int] = []

    def stop_after_first(done: int, total: int) -> None:
        reported.append(done)
        cancel.set()

    # Set as step 1 ends: step 2 stops before its first block runs, not at its end.
    with pytest.raises(Cancelled, match="inside a step"):
        engine.videos.generate("a fox", frames=5, width=64, height=64, steps=3, progress=stop_after_first,
                               cancel=cancel)
    assert reported == [1]
    # The scheduler is its own again: a later call runs all its steps.
    steps.clear()
    engine.videos.generate("a fox", frames=5, width=64, height=64, steps=2, seed=1,
                           progress=lambda done, total: steps.append((done, total)))
    assert steps == [(1, 2), (2, 2)]
    assert "step" not in vars(engine.images.session.pipeline.scheduler)  # type: ignore[union-attr]
    engine.images.unload()
