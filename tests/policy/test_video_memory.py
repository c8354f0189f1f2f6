"""A clip's headroom from its checkpoint's figures, checked against counted bytes, and
"video on this machine" in info and doctor: the default clip's plan and the longest clip
that plans better."""

from __future__ import annotations

import dataclasses

import pytest

from engine import Engine
from engine.contract.plugins import load_registry
from engine.contract.types import VideoMemory
from engine.hardware.presets import preset
from engine.hardware.profile import GIB_IN_GB
from engine.policy.activations import ImageShape, video_overhead_gb
from engine.policy.inference import ModelFacts, plan_inference
from engine.policy.video_fit import clip_fit
from engine.requests.inference import InferenceRequest
from engine.service.doctor import doctor_report, format_doctor
from tests.support import load_bench_script

REGISTRY = load_registry()
WAN = REGISTRY.family("wan")
TI2V = WAN.checkpoint("wan2.2-ti2v-5b")


def overhead(frames: int, width: int, height: int, checkpoint: object = TI2V) -> float:
    return video_overhead_gb(WAN, checkpoint, ImageShape(width, height, 1, frames=frames), 2, 0.0)[0]  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_plan_holds_what_a_tiled_decode_counts_within_ten_percent() -> None:
    """TI2V-5B's real-width VAE decodes a clip under fake tensors (every op at its real shape,
    nothing computed); the plan's figure for that clip is within 10% of the bytes it held."""
    bench = load_bench_script("video_memory")
    denoiser, decode = bench.measure(bench.CASES["wan2.2-ti2v-5b"], 17, 512, 256)
    held = max(denoiser, decode) / 1e9 + 1 * GIB_IN_GB
    assert decode > denoiser  # a short clip's peak is the decode's tile, not the DiT
    assert overhead(17, 512, 256) == pytest.approx(held, rel=0.10)


def test_the_overhead_grows_with_frames_and_tiles_as_the_decode_does() -> None:
    """One tile's working set bounds a short clip; a long, large clip's assembly (every tile's
    frames plus three copies of the clip) takes over; the denoiser term grows with tokens."""
    short, long = overhead(33, 640, 352), overhead(121, 640, 352)
    assert short < long < overhead(121, 1280, 704)
    # The bench's counted peaks (docs/benchmarks.md), within 10%: 33x640x352 and 121x1280x704.
    assert short == pytest.approx(2.56, rel=0.10) and overhead(121, 1280, 704) == pytest.approx(7.19, rel=0.10)
    # Without figures the plan keeps the generic rule: 4 GiB plus three fp32 copies of the clip.
    bare = dataclasses.replace(TI2V, video=dataclasses.replace(TI2V.video, memory=None))  # type: ignore[arg-type]
    assert overhead(121, 1280, 704, bare) == pytest.approx(4 * GIB_IN_GB + 3 * 121 * 1280 * 704 * 12 / 1e9)
    with pytest.raises(ValueError, match="tile_stride_px"):
        VideoMemory(denoiser_per_token=1.0, decode_tile_elements=1.0, tile_px=256, tile_stride_px=300)


def test_the_longest_clip_that_runs_resident_is_the_planner_s_own_boundary() -> None:
    """On a 4090 TI2V-5B's 121 frames offload; the hint's clip plans resident and the next
    count up the lattice does not (the search finds the boundary, not a guess)."""
    hardware = preset("rtx4090")
    fit = clip_fit(REGISTRY, WAN, TI2V, hardware)
    assert fit.ok and fit.does.endswith("model_offload") and fit.better_frames is not None
    facts = ModelFacts(WAN, TI2V, REGISTRY.component_sizes(WAN, TI2V))

    def mode(frames: int) -> str:
        return plan_inference(REGISTRY, facts, hardware, InferenceRequest(frames=frames)).value("memory_mode")

    assert mode(fit.better_frames) == "resident" and mode(fit.better_frames + 4) != "resident"
    assert fit.hint() == f"--frames {fit.better_frames} ({fit.better_frames / 24:.1f} s at 24 fps) plans " \
                         f"bf16 dense, resident here"
    # On a T4 nothing shorter helps (no bf16): the refusal, and no hint.
    t4 = clip_fit(REGISTRY, WAN, TI2V, preset("t4"))
    assert not t4.ok and "native bf16" in t4.reason and t4.hint() is None


def test_info_and_doctor_answer_video_on_this_machine() -> None:
    """``info`` plans every video checkpoint's default clip; doctor names the clip and the flag."""
    engine = Engine(registry=REGISTRY, hardware=preset("rtx4090"))
    clips = engine.catalog.info("wan")["families"]["wan"]["video"]  # type: ignore[index]
    assert set(clips) == {c.name for c in WAN.checkpoints}
    assert clips["wan2.1-t2v-1.3b"]["does"] == "bf16 dense, resident"
    assert clips["wan2.2-ti2v-5b"]["hint"].startswith("--frames ")
    assert "video" not in engine.catalog.info("flux")["families"]["flux"]  # type: ignore[index]
    report = doctor_report(engine, hardware=preset("rtx4090"))
    verdict = report["families"]["wan"]["inference"]  # type: ignore[index]
    assert verdict["does"].startswith("121 frames of 1280x704 at 24 fps: bf16 dense, model_offload")
    assert verdict["better"][0] == clips["wan2.2-ti2v-5b"]["hint"]
    assert "121 frames of 1280x704" in format_doctor(report)
