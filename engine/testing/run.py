"""Run a family's tiny model end to end through the engine (the kit's model check).

Build the tiny pipeline, load it with :class:`~engine.service.facade.Engine`,
generate one image, train two LoRA steps with the engine's preflight and
trainer (in this process: the registry, with any plugin a test registered,
is the one the trainer's hooks go through), then generate again with the
saved LoRA through the engine and check that the image changed. Every stage
is reported; the first that fails is named with its error, so a kit failure
says where the family broke.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.contract.types import FamilySpec

#: Big enough that two steps of a rank-4 LoRA move 8-bit pixels.
KIT_LEARNING_RATE = 5e-2
KIT_LORA_SCALE = 4.0
KIT_PROMPT = "a red circle on a blue background"


@dataclass
class RunReport:
    """What happened at each stage; ``failure`` names the first that failed."""

    stages: list[str] = field(default_factory=list)
    failure: str | None = None
    lora: Path | None = None
    plan: dict[str, object] | None = None
    capabilities: dict[str, object] | None = None
    train_events: list[dict[str, object]] = field(default_factory=list)


def run_model(
    registry: Registry, family: FamilySpec, workdir: Path, *,
    folder: Path | None = None, size: int = 64, steps: int = 2,
) -> RunReport:
    """Run ``family``'s tiny model (``folder``, else built here) through the
    engine; never raises for the model's own failures."""
    report = RunReport()
    stage = "build the tiny pipeline"
    try:
        folder = folder or registry.build_tiny_pipeline(family, workdir / "tiny")
        report.stages.append(stage)
        stage = "load and generate through the engine"
        if family.rendering.output == "frames":
            stage = "load and render a clip through the engine, written as MP4 and decoded"
            engine, base = _load_and_render(registry, folder, family, size, steps, workdir)
        else:
            engine, base = _load_and_generate(registry, folder, family, size, steps)
        status = engine.status()["pipeline"]
        report.plan, report.capabilities = status["plan"], status["capabilities"]  # type: ignore[index]
        report.stages.append(stage)
        if registry.training_objective(family) is None:  # not trainable: nothing more to claim
            engine.images.unload()
            return report
        stage = "train 2 LoRA steps"
        report.lora = _train(registry, family, folder, workdir, report)
        report.stages.append(stage)
        stage = "reload the LoRA through the engine and generate"
        loras = [f"{report.lora}:{KIT_LORA_SCALE}"]
        if family.rendering.output == "frames":
            clip = engine.videos.generate(KIT_PROMPT, frames=_frames_of(engine, family), steps=steps, width=size, height=size,
                                          seed=0, loras=loras)
            after = b"".join(_pixels(frame) for frame in clip.frames)
        else:
            after = _pixels(engine.images.generate(KIT_PROMPT, steps=steps, width=size, height=size, seed=0,
                                                   loras=loras)[0])
        engine.images.unload()
        if after == base:
            report.failure = f"{stage}: the {'clip' if family.rendering.output == 'frames' else 'image'} did not change " \
                             "with the trained LoRA loaded"
            return report
        report.stages.append(stage)
    except Exception as exc:  # the kit reports any failure of the family's code, as a failure
        detail = exc.message if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
        where = traceback.extract_tb(exc.__traceback__)[-1]
        report.failure = f"{stage} failed: {detail} (at {Path(where.filename).name}:{where.lineno})"
    return report


def _load_and_generate(
    registry: Registry, folder: Path, family: FamilySpec, size: int, steps: int
) -> tuple[Any, bytes]:
    from engine.hardware.probe import probe
    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine

    engine = Engine(registry=registry, hardware=probe(verify=False))
    request = InferenceRequest(width=size, height=size, compile="off")
    engine.images.load(str(folder), family=family.name, request=request, switching=True)
    images = engine.images.generate(KIT_PROMPT, steps=steps, width=size, height=size, seed=0)
    if not images or images[0].size != (size, size):
        raise AssertionError(f"generate returned {images!r}, not one {size}x{size} image")
    low, high = images[0].convert("L").getextrema()
    if low == high:
        raise AssertionError("the generated image is a single flat colour")
    return engine, _pixels(images[0])


def _load_and_render(
    registry: Registry, folder: Path, family: FamilySpec, size: int, steps: int, workdir: Path
) -> tuple[Any, bytes]:
    """A video family's run: the shortest clip of more than one latent frame, at ``size``,
    through ``engine.videos``; the MP4 it writes decodes to the frames, size and fps asked."""
    from engine.hardware.probe import probe
    from engine.requests.inference import InferenceRequest
    from engine.runtime.video_files import read_mp4
    from engine.service.facade import Engine

    engine = Engine(registry=registry, hardware=probe(verify=False))
    engine.images.load(str(folder), family=family.name, request=InferenceRequest(width=size, height=size,
                                                                                  compile="off"))
    session = engine.images.session
    assert session is not None
    spec = family.video_of(session.source.checkpoint)
    assert spec is not None, "a family whose output is frames declares its VideoSpec (Rendering.video)"
    frames = kit_frames(spec)
    clip = engine.videos.generate(KIT_PROMPT, frames=frames, steps=steps, width=size, height=size, seed=0)
    decoded, fps = read_mp4(clip.save(workdir / "clip.mp4"))
    if len(decoded) != frames or decoded[0].size != (size, size) or round(fps) != spec.fps:
        raise AssertionError(f"the MP4 holds {len(decoded)} frames of {decoded[0].size if decoded else None} at "
                             f"{fps} fps, not {frames} of {size}x{size} at {spec.fps}")
    low, high = clip.frames[0].convert("L").getextrema()
    if low == high:
        raise AssertionError("the rendered clip's first frame is a single flat colour")
    if spec.audio:
        check_sound(spec, workdir / "clip.mp4", frames / fps)
    return engine, b"".join(_pixels(frame) for frame in clip.frames)


#: How far a clip's sound may run from its picture's length: a pipeline's audio latents round
#: the duration (a causal audio VAE drops a few mel frames), and AAC pads its last frame.
SOUND_SLACK_S = 0.1


def check_sound(spec: Any, mp4: Path, seconds: float) -> None:
    """A sound family's MP4 carries an audio stream at its declared rate, as long as the picture."""
    from engine.runtime.video_files import read_sound

    sound = read_sound(mp4)
    if sound is None:
        raise AssertionError("the family declares sound (VideoSpec.audio), but its MP4 has no audio stream: "
                             "the clip's track was dropped (engine_pipeline_sound)")
    if spec.audio_rate is not None and sound.sample_rate != spec.audio_rate:
        raise AssertionError(f"the MP4's sound is {sound.sample_rate} Hz, not the declared {spec.audio_rate}")
    slack = max(SOUND_SLACK_S, 0.15 * seconds)
    if abs(sound.seconds - seconds) > slack:
        raise AssertionError(f"the sound lasts {sound.seconds:.3f} s against the picture's {seconds:.3f} s")


def _train(registry: Registry, family: FamilySpec, folder: Path, workdir: Path, report: RunReport) -> Path:
    from engine.hardware.probe import probe
    from engine.testing.datasets import write_clip_dataset, write_dataset
    from engine.requests.training import TrainingConfig
    from engine.training.preflight import preflight_training
    from engine.training.trainer import run_training

    spec = family.video_of(registry_checkpoint(registry, folder)) if family.rendering.output == "frames" else None
    if spec is not None:  # a video family trains on real clips (and an image) at the kit's length, with sound where it trains it
        heard = family.training is not None and family.training.sound is not None
        data = write_clip_dataset(workdir / "data", clips=2, images=1, frames=max(9, kit_frames(spec)), fps=spec.fps,
                                  tone_hz=440.0 if heard else None)
    else:
        data = write_dataset(workdir / "data", count=2)
    config = TrainingConfig.from_data({
        "base_model": str(folder), "family": family.name, "dataset_dir": str(data),
        "resolution": 64, "steps": 2, "lora_rank": 4, "learning_rate": KIT_LEARNING_RATE,
        "device": "cpu", "compile": "off", "mixed_precision": "no",
        **({"frames": kit_frames(spec)} if spec is not None else {}),
    })
    plan = preflight_training(registry, config, probe(verify=False))
    result = run_training(plan, workdir / "lora", report.train_events.append, lambda: None, registry=registry)
    if result.get("type") != "completed":
        raise AssertionError(f"training ended {result.get('type')}: {result}")
    return Path(str(result["outputs"]["lora"]))  # type: ignore[index]


def kit_frames(spec: Any) -> int:
    """The kit's clip: the shortest of more than one latent frame (5 on a 4k+1 lattice)."""
    return int(spec.snap(spec.frame_offset + spec.frame_step))


def _frames_of(engine: Any, family: FamilySpec) -> int:
    session = engine.images.session
    return kit_frames(family.video_of(session.source.checkpoint if session is not None else None))


def registry_checkpoint(registry: Registry, folder: Path) -> Any:
    """The checkpoint the folder is (its family table's match), as the engine resolves it."""
    from engine.preflight.model import resolve_model

    return resolve_model(registry, folder).checkpoint


def _pixels(image: object) -> bytes:
    return image.convert("RGB").tobytes()  # type: ignore[attr-defined]
