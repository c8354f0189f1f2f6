"""LTX-2 LoRAs trained on clips with their sound (and on stills as one-frame clips), for real on
the CPU: clips written with PyAV (a tone beside the picture, and a silent one), the tiny LTX2Pipeline.

The window reads the sound at the audio VAE's 16 kHz (its vocoder writes 24 kHz); the report
names the silent clip; each step reports the picture's loss and the sound's where one was
heard; under fixed noise the trained LoRA predicts the toned clip's picture and sound better
than the base; the LoRA moves a generated clip's picture and sound (scale 0 is the base); and
a run on stills alone trains the picture with the sound made up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.requests.training import TrainingConfig
from engine.testing.datasets import write_clip, write_dataset
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.trainer import run_training
from families.ltx2.tiny import TINY_FRAMES

REGISTRY = load_registry()
STEPS = 12


def _train(base: Path, data: Path, folder: Path, steps: int, **extra: object) -> tuple[TrainingPlan, list[dict[str, object]]]:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "frames": TINY_FRAMES, "lora_rank": 8,
        "learning_rate": 2e-2, "warmup_steps": 0, "device": "cpu", "seed": 7, "steps": steps, **extra,
    })
    plan = preflight_training(REGISTRY, config, probe(verify=False))
    events: list[dict[str, object]] = []
    end = run_training(plan, folder, events.append, lambda: None, registry=REGISTRY)
    assert end["type"] == "completed", end
    return plan, events


@pytest.fixture(scope="module")
def trained(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
            ) -> tuple[TrainingPlan, Path, list[dict[str, object]]]:
    data = tmp_path_factory.mktemp("ltx2-clips")
    write_clip(data / "tone.mp4", frames=12, fps=24, tone_hz=440.0).with_suffix(".txt").write_text("a tone")
    write_clip(data / "quiet.mp4", frames=12, fps=24, index=1).with_suffix(".txt").write_text("quiet")
    folder = tmp_path_factory.mktemp("ltx2-run") / "out"
    plan, events = _train(tiny_pipeline("ltx2"), data, folder, STEPS, export_kohya=True)
    return plan, folder, events


@pytest.mark.slow
def test_the_sound_is_read_at_the_audio_vaes_rate_and_the_silent_clip_is_named(trained: tuple) -> None:
    plan, _, events = trained
    assert plan.window is not None and (plan.window.frames, plan.window.sound_rate) == (TINY_FRAMES, 16000)
    assert plan.dataset.silent == ("quiet.mp4",)
    steps = [e for e in events if e["type"] == "progress"]
    heard = [e for e in steps if "loss_sound" in e]
    assert len(steps) == STEPS and all("loss_video" in e for e in steps) and 0 < len(heard) < STEPS


@pytest.mark.slow
def test_under_fixed_noise_the_lora_predicts_the_clips_picture_and_sound_better(trained: tuple) -> None:
    """Fixed noise at sigma 0.5: the picture's error 1.07 -> 0.61 and the sound's 1.67 -> 1.46 here
    in 12 steps (0.31 and 1.40 in 24); a 24-step run with the sound's loss weighted 0 left the
    sound's error at 2.12 (worse than the base), so the sound's fall is its own training."""
    from engine.testing.sound_training import base_and_trained

    plan, folder, _ = trained
    base, lora = base_and_trained(plan, folder / "pytorch_lora_weights.safetensors", "tone.mp4", "a tone")
    assert lora.picture < 0.9 * base.picture and lora.sound < 0.9 * base.sound, (base, lora)


@pytest.mark.slow
def test_the_trained_lora_moves_a_generated_clips_picture_and_sound(trained: tuple) -> None:
    from engine.testing.sound_training import check_lora_moves_clip

    plan, folder, _ = trained
    asked = {"prompt": "a tone", "model": plan.base.location, "frames": TINY_FRAMES, "width": 64, "height": 64,
             "steps": 2, "seed": 3, "guidance": 1.0}
    check_lora_moves_clip(REGISTRY, asked, folder / "pytorch_lora_weights.safetensors")


@pytest.mark.slow
def test_stills_train_as_one_frame_clips_with_their_sound_made_up(tiny_pipeline: Callable[[str], Path],
                                                                   tmp_path: Path) -> None:
    """The earlier system's LTX-2 recipe: images alone, each a one-frame clip; no sound is heard,
    so the steps report the picture's loss alone."""
    data = write_dataset(tmp_path / "stills", count=2, size=64)
    plan, events = _train(tiny_pipeline("ltx2"), data, tmp_path / "out", 2)
    steps = [e for e in events if e["type"] == "progress"]
    assert plan.dataset.clips == 0 and len(steps) == 2
    assert all("loss_video" in e and "loss_sound" not in e for e in steps)


@pytest.mark.slow
def test_the_kohya_export_names_the_original_modules_and_loads_as_the_diffusers_file(trained: tuple) -> None:
    """``export_kohya``: ``lora_unet_<module>`` with LTX-2's original module names (its attention
    modules keep them in diffusers: diffusers' own LTX-2 converter renames none of them), read
    back by the engine's LoRA door into the same clip, picture and sound, as the diffusers file."""
    import numpy as np
    from safetensors.torch import load_file

    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine

    plan, folder, _ = trained
    kohya = load_file(str(folder / "lora_kohya.safetensors"))
    modules = {key.split(".")[0] for key in kohya}
    assert modules and all(m.startswith("lora_unet_transformer_blocks_") for m in modules)
    assert any("_audio_attn1_to_q" in m for m in modules) and any("_attn1_to_q" in m for m in modules)
    asked = {"prompt": "a tone", "model": plan.base.location, "frames": TINY_FRAMES, "width": 64, "height": 64,
             "steps": 2, "seed": 3, "guidance": 1.0}
    with Engine(registry=REGISTRY, hardware=probe(verify=False)) as engine:
        ours = engine.videos.generate(GenerateBody(**asked), loras=[f"{folder / 'pytorch_lora_weights.safetensors'}:1.0"])  # type: ignore[arg-type]
        theirs = engine.videos.generate(GenerateBody(**asked), loras=[f"{folder / 'lora_kohya.safetensors'}:1.0"])  # type: ignore[arg-type]
    assert [f.tobytes() for f in ours.frames] == [f.tobytes() for f in theirs.frames]
    assert ours.sound is not None and theirs.sound is not None
    assert np.allclose(ours.sound.samples, theirs.sound.samples, atol=1e-5)
