"""The small edges a first clip meets, at the door where each was found."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.cli import main


def test_a_png_asked_of_a_video_model_is_refused_not_an_mp4_named_png(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "clip.png"
    status = main(["generate", "--model", str(tiny_pipeline("wan")), "--prompt", "a fox", "--frames", "9",
                   "--steps", "1", "-o", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and "error[wrong_output]" in err and "-o clip.mp4" in err
    assert not out.exists()


@pytest.mark.slow
def test_tiny_save_of_a_video_family_suggests_a_clip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny", "save", "wan", str(tmp_path / "wan")]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert "--frames 9 -o fox.mp4" in hint and "fox.png" not in hint
    assert main(["tiny", "save", "sdxl", str(tmp_path / "sdxl")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("-o fox.png")


def test_an_http_refusal_gives_the_requests_own_advice_not_only_flags() -> None:
    """The wrong door's refusal names the fields and the routes (a client has no --frames)."""
    from engine.contract.plugins import load_registry
    from engine.errors import EngineError
    from engine.policy.video import check_output

    registry = load_registry()
    with pytest.raises(EngineError) as images:
        check_output(registry.family("sdxl"), "frames")
    with pytest.raises(EngineError) as video:
        check_output(registry.family("wan"), "images")
    assert "drop frames and fps" in images.value.message and "POST /v1/images/generations" in images.value.message
    assert "POST /v1/videos" in video.value.message


def test_seconds_that_land_on_the_lattice_still_say_what_they_became() -> None:
    """4 s at Wan TI2V's 24 fps is exactly 97 frames: the video object's ``snapped`` says so
    (it was null, leaving a client to guess how 4 s was rendered)."""
    from engine.contract.plugins import load_registry
    from engine.policy.video import frames_for_seconds

    wan = load_registry().family("wan")
    exact = frames_for_seconds(wan, wan.checkpoint("wan2.2-ti2v-5b"), 4.0)
    assert (exact.frames, exact.snapped) == (97, False) and exact.note() == "97 frames at 24 fps (on the frame lattice as asked)"
    moved = frames_for_seconds(wan, wan.checkpoint("wan2.2-ti2v-5b"), 4.1)
    assert moved.snapped and "snapped to" in moved.note()


@pytest.mark.slow
def test_a_tiny_video_model_renders_a_tiny_clip_when_the_request_is_silent(
    tmp_path: Path, cli_json: Callable[..., object],
) -> None:
    """``tiny save wan`` then a generate with no frames and no size: the model's own short clip at
    64 px (was its checkpoint's 121 frames of 1280x704), from the CLI and from Python alike."""
    from engine import Engine
    from engine.requests import GenerateBody

    assert main(["tiny", "save", "wan", str(tmp_path / "wan")]) == 0
    report = cli_json("generate", "--model", str(tmp_path / "wan"), "--prompt", "a fox", "--steps", "1",
                      "-o", str(tmp_path / "clip.mp4"))
    assert (report["frames"], report["width"], report["height"]) == (5, 64, 64)  # type: ignore[index]
    with Engine() as engine:
        ticket = engine.videos.check_generate(GenerateBody(prompt="a fox", model=str(tmp_path / "wan")))
        assert ticket.shape is not None and (ticket.shape.frames, ticket.shape.width) == (5, 64)
        # Planned for its own clip too: the same estimate, but for the budget (this machine's free
        # memory, read at each plan, moves between the two).
        ours, theirs = (dict(p.to_dict()["estimate"]) for p in (ticket.plan, engine.images.plan(str(tmp_path / "wan"))))
        assert ours.pop("budget_gb") == pytest.approx(theirs.pop("budget_gb"), abs=0.5) and ours == theirs


@pytest.mark.slow
def test_the_low_noise_experts_guidance_is_set_per_request_at_every_door(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path], cli_json: Callable[..., object],
) -> None:
    """Wan 2.2 A14B's ``guidance_scale_2``: the request's where it gives one (Python, the CLI's
    --guidance-2, HTTP's guidance_2), the checkpoint's otherwise; refused for a one-denoiser model."""
    from engine import Engine
    from engine.contract.hookspecs import hookimpl
    from engine.contract.plugins import load_registry
    from engine.errors import EngineError
    from engine.requests import GenerateBody
    from families.wan.tiny import build_tiny_two_experts

    seen: list[object] = []

    class Spy:
        @hookimpl
        def engine_generate_kwargs(self, family: object, pipeline: object, kwargs: dict[str, object]) -> None:
            seen.append(kwargs.get("guidance_scale_2"))

    base = build_tiny_two_experts(tmp_path / "a14b")
    registry = load_registry(plugins=[("spy", Spy())])
    asked = {"prompt": "a fox", "model": str(base), "frames": 5, "steps": 2, "width": 64, "height": 64}
    with Engine(registry=registry) as engine:
        clip = engine.videos.generate(GenerateBody(**asked, guidance_2=2.5))
        engine.videos.generate(GenerateBody(**asked))
        with pytest.raises(EngineError, match="one denoiser") as refused:
            engine.videos.check_generate(GenerateBody(**{**asked, "model": str(tiny_pipeline("wan"))}, guidance_2=2.5))
    assert seen == [2.5, 3.0] and clip.recipe["guidance_2"] == 2.5 and refused.value.code == "invalid_request"
    from engine.server.video_routes import OpenAIVideoBody

    assert OpenAIVideoBody(prompt="x", guidance_2=2.5).guidance_2 == 2.5  # the HTTP form takes it too
