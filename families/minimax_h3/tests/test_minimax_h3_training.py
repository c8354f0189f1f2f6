"""MiniMax-H3 LoRAs trained on clips with their sound, for real on the CPU: clips written with
PyAV (a tone beside the picture, and one silent clip), the tiny modular pipeline.

The dataset report names the silent clip; the run reports the picture's and the sound's loss
each step (the sound's only where a clip with sound was heard); under fixed noise the trained
LoRA predicts both the training clip's picture and its sound better than the base; and the
LoRA it saved loads through the engine's LoRA door onto the modular pipeline, moving the
generated clip's picture and sound (scale 0 is the base).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.requests.training import TrainingConfig
from engine.testing.datasets import write_clip
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.trainer import run_training
from families.minimax_h3.table import AUDIO_RATE
from families.minimax_h3.tiny import TINY_FRAMES

REGISTRY = load_registry()
STEPS = 24


@pytest.fixture(scope="module")
def trained(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
            ) -> tuple[TrainingPlan, Path, list[dict[str, object]]]:
    data = tmp_path_factory.mktemp("h3-clips")
    write_clip(data / "tone.mp4", frames=TINY_FRAMES, fps=24, tone_hz=440.0).with_suffix(".txt").write_text("a tone")
    write_clip(data / "quiet.mp4", frames=TINY_FRAMES, fps=24, index=1).with_suffix(".txt").write_text("quiet")
    config = TrainingConfig.from_data({
        "base_model": str(tiny_pipeline("minimax_h3")), "dataset_dir": str(data), "resolution": 64, "lora_rank": 8,
        "learning_rate": 2e-2, "warmup_steps": 0, "device": "cpu", "seed": 7, "steps": STEPS,
        "save_every": STEPS // 2, "sample_prompts": ["a tone"], "sample_every": STEPS, "sample_steps": 2,
    })
    plan = preflight_training(REGISTRY, config, probe(verify=False))
    folder = tmp_path_factory.mktemp("h3-run") / "out"
    events: list[dict[str, object]] = []
    end = run_training(plan, folder, events.append, lambda: None, registry=REGISTRY)
    assert end["type"] == "completed", end
    return plan, folder, events


@pytest.mark.slow
def test_the_window_trains_the_sound_and_the_report_names_the_silent_clip(trained: tuple) -> None:
    plan, _, _ = trained
    window = plan.window
    assert window is not None and (window.frames, window.fps, window.sound_rate) == (TINY_FRAMES, 24.0, AUDIO_RATE)
    assert plan.dataset.silent == ("quiet.mp4",)
    assert "1 clip(s) have no sound and train the picture alone: quiet.mp4" in plan.dataset.warnings()


@pytest.mark.slow
def test_each_step_reports_the_pictures_loss_and_the_sounds_where_one_was_heard(trained: tuple) -> None:
    _, _, events = trained
    steps = [e for e in events if e["type"] == "progress"]
    assert len(steps) == STEPS and all("loss_video" in e for e in steps)
    heard = [e for e in steps if "loss_sound" in e]
    assert 0 < len(heard) < STEPS  # the silent clip's steps train the picture alone
    for event in heard:
        assert event["loss"] == pytest.approx(event["loss_video"] + event["loss_sound"], rel=1e-5)
    first, last = heard[:3], heard[-3:]
    assert sum(e["loss_sound"] for e in last) < 0.8 * sum(e["loss_sound"] for e in first)


@pytest.mark.slow
def test_a_resume_continues_bit_for_bit_with_the_sound_drawn_as_before(trained: tuple, tmp_path: Path) -> None:
    """Resumed from the half-way checkpoint, the run ends on the same LoRA: the sound's noise and
    times come from each example's own generator, as the picture's do."""
    from safetensors.torch import load_file

    plan, folder, _ = trained
    [checkpoint] = [p for p in (folder / "checkpoints").iterdir() if p.name.endswith(f"{STEPS // 2:08d}")]
    resumed = preflight_training(REGISTRY, plan.config.model_copy(update={"resume_from": checkpoint}),
                                 probe(verify=False))
    end = run_training(resumed, tmp_path / "resumed", lambda _event: None, lambda: None, registry=REGISTRY)
    whole, again = load_file(str(folder / "pytorch_lora_weights.safetensors")), load_file(end["outputs"]["lora"])
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


@pytest.mark.slow
def test_samples_are_mp4_clips_with_their_sound(trained: tuple) -> None:
    from engine.runtime.video_files import read_mp4, read_sound

    _, _, events = trained
    [samples] = [e for e in events if e["type"] == "samples"]
    [sample] = samples["samples"]  # type: ignore[misc]
    frames, fps = read_mp4(Path(sample["clip"]))
    sound = read_sound(Path(sample["clip"]))
    assert len(frames) == TINY_FRAMES and round(fps) == 24
    assert sound is not None and (sound.sample_rate, sound.channels) == (AUDIO_RATE, 2)
    assert abs(sound.seconds - TINY_FRAMES / 24) < 0.1


@pytest.mark.slow
def test_under_fixed_noise_the_lora_predicts_the_clips_picture_and_sound_better(trained: tuple) -> None:
    """The training clip, noised once with fixed noise at sigma 0.5, is predicted closer to the
    truth with the LoRA than by the base, both streams."""
    from engine.testing.sound_training import base_and_trained

    plan, folder, _ = trained
    base, lora = base_and_trained(plan, folder / "pytorch_lora_weights.safetensors", "tone.mp4", "a tone")
    assert lora.picture < 0.9 * base.picture and lora.sound < 0.8 * base.sound, (base, lora)


@pytest.mark.slow
def test_the_saved_lora_moves_a_generated_clips_picture_and_sound(trained: tuple) -> None:
    """The engine's LoRA door on the modular pipeline: the picture and the sound both move; at
    scale 0 the clip is the base's."""
    from engine.testing.sound_training import check_lora_moves_clip

    plan, folder, _ = trained
    asked = {"prompt": "a tone", "model": plan.base.location, "frames": TINY_FRAMES, "width": 64, "height": 64,
             "steps": 3, "seed": 3}
    check_lora_moves_clip(REGISTRY, asked, folder / "pytorch_lora_weights.safetensors")


def test_a_clip_whose_sound_is_broken_is_refused_before_anything_is_evicted(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    """The 0-eviction matrix's sound case: the start's preflight reads each clip's sound window."""
    from engine.errors import EngineError
    from engine.service.facade import Engine
    from tests.support import HostModel

    data = tmp_path / "data"
    data.mkdir()
    clip = write_clip(data / "tone.mp4", frames=TINY_FRAMES, fps=24, tone_hz=440.0)
    raw = bytearray(clip.read_bytes())
    at = raw.find(bytes([0x05, 0x80, 0x80, 0x80]), raw.find(b"esds")) + 5  # the AAC decoder's own config
    raw[at:at + 2] = b"\xff\xff"
    clip.write_bytes(bytes(raw))
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    with pytest.raises(EngineError) as refused:
        engine.training.start({"base_model": str(tiny_pipeline("minimax_h3")), "dataset_dir": str(data),
                               "resolution": 64, "steps": 2, "device": "cpu"})
    assert refused.value.code == "bad_dataset" and "its sound cannot be decoded" in refused.value.message
    assert host.evicted == 0 and engine.residency.owner is None
