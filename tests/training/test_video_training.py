"""Video LoRA training on Wan, for real on the CPU: clips written with PyAV, the tiny Wan pipelines.

A run trains on clips and an image side by side, learns (its loss on the
training clip falls under fixed noise), resumes bit for bit, samples MP4s,
and its LoRA changes a generated clip (scale 0 is the base). The A14B-shaped
base trains either expert or both, each on its own sigmas; the export's keys
are the original checkpoint's (checked against its published module names);
the memory estimate for a clip run matches the bytes a real-width step holds
under fake tensors; and every doomed start is refused before anything is evicted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.contract.plugins import load_registry
from engine.errors import EngineError, PreflightError
from engine.hardware.presets import PRESETS
from engine.hardware.probe import probe
from engine.requests.training import TrainingConfig
from engine.runtime.video_files import read_mp4
from engine.service.facade import Engine
from engine.testing.datasets import write_clip, write_clip_dataset, write_dataset
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.trainer import run_training

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
#: The tiny TI2V-shaped Wan renders and trains at 24 fps; a 5-frame clip is two latent frames.
FRAMES, SIZE, STEPS = 5, 64, 24
REFERENCE_KEYS = Path(__file__).parents[1] / "data" / "wan21_original_block_keys.txt"


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_clip_dataset(tmp_path_factory.mktemp("clips"), clips=2, images=1, frames=9)


def _plan(base: Path, data: Path, **fields: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": SIZE, "frames": FRAMES,
        "lora_rank": 8, "learning_rate": 2e-2, "warmup_steps": 0, "device": "cpu", "seed": 7, **fields,
    })
    return preflight_training(REGISTRY, config, HARDWARE)


def _train(plan: TrainingPlan, folder: Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    events: list[dict[str, object]] = []
    end = run_training(plan, folder, events.append, lambda: None, registry=REGISTRY)
    assert end["type"] == "completed", end
    return end, events


@pytest.fixture(scope="module")
def trained(tiny_pipeline: Callable[[str], Path], clips: Path,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingPlan, Path, list[dict[str, object]]]:
    plan = _plan(tiny_pipeline("wan"), clips, steps=STEPS, save_every=STEPS // 2, sample_prompts=["a square"],
                 sample_every=STEPS, sample_steps=2, export_kohya=True)
    folder = tmp_path_factory.mktemp("run") / "out"
    _, events = _train(plan, folder)
    return plan, folder, events


def test_a_run_plans_clips_and_images_in_their_own_buckets(trained: tuple[TrainingPlan, Path, list]) -> None:
    plan, _, _ = trained
    assert plan.window is not None and (plan.window.frames, plan.window.fps) == (FRAMES, 24.0)
    assert plan.expert is None  # TI2V-5B has one denoiser
    shapes = {(b.frames, b.width, b.height): len(b.images) for b in plan.buckets.buckets}  # type: ignore[union-attr]
    assert shapes == {(FRAMES, SIZE, SIZE): 2, (1, SIZE, SIZE): 1}
    assert plan.to_dict()["dataset"]["clips"] == 2  # type: ignore[index]


def test_the_loss_on_the_training_clip_falls(trained: tuple[TrainingPlan, Path, list]) -> None:
    """Under fixed noise and sigmas, the trained LoRA denoises the dataset's clips better than the base."""
    from diffusers import WanPipeline

    from engine.contract.family_runtime import load_runtime
    from engine.training.inputs import cache_inputs

    plan, folder, _ = trained
    pipe = WanPipeline.from_pretrained(plan.base.location, dtype=torch.float32)
    runtime = load_runtime(plan.family)
    latents, conditioning, captions = cache_inputs(plan, pipe, runtime, torch.device("cpu"), torch.float32,
                                                   lambda: None)

    def held_out_loss() -> float:
        generator, total = torch.Generator().manual_seed(11), 0.0
        for index, x0 in enumerate(latents):
            row = captions.per_image[index][0]
            cond = {k: v[[row]] for k, v in conditioning.items()}
            for sigma in (0.2, 0.5, 0.8):
                noise = torch.randn(x0.shape, generator=generator).unsqueeze(0)
                noisy = (1 - sigma) * x0.unsqueeze(0) + sigma * noise
                with torch.no_grad():
                    prediction = runtime.predict(pipe, pipe.transformer, noisy, torch.tensor([sigma]), cond)
                total += float(torch.nn.functional.mse_loss(prediction, noise - x0.unsqueeze(0)))
        return total

    before = held_out_loss()
    pipe.load_lora_weights(str(folder))
    after = held_out_loss()
    assert after < 0.9 * before, (before, after)  # 12.43 -> 9.63 when written


def test_a_resume_continues_bit_for_bit(trained: tuple[TrainingPlan, Path, list], tmp_path: Path) -> None:
    plan, folder, _ = trained
    [checkpoint] = [p for p in (folder / "checkpoints").iterdir() if p.name.endswith(f"{STEPS // 2:08d}")]
    resumed = preflight_training(REGISTRY, plan.config.model_copy(update={"resume_from": checkpoint}), HARDWARE)
    end, _ = _train(resumed, tmp_path / "resumed")
    whole, again = load_file(str(folder / "pytorch_lora_weights.safetensors")), load_file(end["outputs"]["lora"])
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def test_samples_are_mp4_clips_at_the_family_fps(trained: tuple[TrainingPlan, Path, list]) -> None:
    _, _, events = trained
    [samples] = [e for e in events if e["type"] == "samples"]
    [sample] = samples["samples"]  # type: ignore[misc]
    frames, fps = read_mp4(Path(sample["clip"]))
    assert len(frames) == FRAMES and frames[0].size == (SIZE, SIZE) and round(fps) == 24
    assert Path(sample["path"]).suffix == ".png" and Path(sample["path"]).is_file()


def test_the_lora_changes_a_generated_clip_scale_zero_is_the_base_and_another_family_is_refused(
    trained: tuple[TrainingPlan, Path, list], tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    plan, folder, _ = trained
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(plan.base.location))

    def render(*loras: str) -> bytes:
        clip = engine.videos.generate("a square", frames=FRAMES, steps=2, width=SIZE, height=SIZE, seed=0,
                                      loras=list(loras) or None)
        return b"".join(frame.tobytes() for frame in clip.frames)

    base = render()
    assert render(f"{folder}:1.0") != base
    assert render(f"{folder}:0") == base
    other = tmp_path / "flux_lora.safetensors"
    save_file({f"transformer.single_transformer_blocks.0.attn.to_q.lora_{ab}.weight": torch.zeros(shape)
               for ab, shape in (("A", (4, 3072)), ("B", (3072, 4)))}, str(other))
    with pytest.raises(EngineError) as refused:
        render(str(other))
    assert refused.value.code == "lora_mismatch", refused.value
    engine.images.unload()


def test_the_comfyui_export_names_the_original_checkpoints_modules(trained: tuple[TrainingPlan, Path, list]) -> None:
    """ComfyUI's loader maps ``lora_unet_<key with _>`` to ``diffusion_model.<key>.weight`` of the
    original checkpoint; every exported module must be one of its published names."""
    _, folder, _ = trained
    reference = {line.strip() for line in REFERENCE_KEYS.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.startswith("#")}
    as_lora = {key[: -len(".weight")].replace(".", "_"): key for key in reference if key.endswith(".weight")}
    exported = load_file(str(folder / "lora_kohya.safetensors"))
    modules = {key.split(".")[0] for key in exported}
    assert modules and all(key.split(".", 1)[1] in ("lora_down.weight", "lora_up.weight", "alpha") for key in exported)
    for module in modules:
        name = module.removeprefix("lora_unet_")
        block0 = "blocks_0_" + name.split("_", 2)[2]  # the reference lists block 0's keys
        assert block0 in as_lora, module
    assert {"lora_unet_blocks_0_self_attn_q", "lora_unet_blocks_1_cross_attn_o"} <= modules


@pytest.fixture(scope="module")
def two_experts(clips: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """A tiny A14B-shaped base and a run that trained both its experts: (base, run folder, outputs)."""
    from families.wan.tiny import build_tiny_two_experts

    root = tmp_path_factory.mktemp("a14b")
    base = build_tiny_two_experts(root / "a14b")
    end, _ = _train(_plan(base, clips, steps=6, batch_size=2), root / "both")
    return base, root / "both", end["outputs"]  # type: ignore[return-value]


def test_a_two_expert_base_trains_either_expert_or_both_each_on_its_own_sigmas(
    clips: Path, two_experts: tuple[Path, Path, dict[str, str]], tmp_path: Path,
) -> None:
    from diffusers import WanPipeline

    from engine.training.trainer import _noise

    base, _, outputs = two_experts
    both = _plan(base, clips, steps=6, batch_size=2)
    assert both.expert is not None and both.expert.value.components == ("transformer", "transformer_2")
    assert both.expert.source == "auto" and both.to_dict()["expert"]["value"]["boundary"] == 0.875  # type: ignore[index]
    x0 = torch.zeros(8, 16, 2, 8, 8)
    for name, inside in (("high", lambda s: s >= 0.875), ("low", lambda s: s < 0.875)):
        plan = _plan(base, clips, steps=2, expert=name)
        draws = [torch.Generator().manual_seed(n) for n in range(8)]
        _, sigmas, _ = _noise(plan, x0, None, draws, 3.0, plan.expert.value.sigma_range())  # type: ignore[union-attr]
        assert all(inside(float(s)) for s in sigmas), (name, sigmas)
    high, low = load_file(outputs["lora"]), load_file(outputs["lora_low_noise"])
    for state in (high, low):  # both experts saw steps of their own range and moved
        assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)
    pipe = WanPipeline.from_pretrained(str(base), dtype=torch.float32)
    pipe.load_lora_weights(outputs["lora"], adapter_name="high")
    pipe.load_lora_weights(outputs["lora_low_noise"], adapter_name="low", load_into_transformer_2=True)
    assert "low" in pipe.transformer_2.peft_config and "high" in pipe.transformer.peft_config
    only_low, events = _train(_plan(base, clips, steps=2, expert="low", sample_prompts=["a square"],
                                    sample_every=2, sample_steps=2), tmp_path / "low")
    assert set(only_low["outputs"]) == {"lora"}  # type: ignore[arg-type]
    [samples] = [event["samples"] for event in events if event["type"] == "samples"]
    assert len(read_mp4(Path(samples[0]["clip"]))[0]) == FRAMES  # type: ignore[index]  # both experts rendered it


def test_a_one_expert_run_loads_its_expert_after_caching_and_the_other_only_for_samples(
    clips: Path, two_experts: tuple[Path, Path, dict[str, str]],
) -> None:
    """The caching phase holds the encoders and the VAE alone; a ``--expert low`` run then loads
    ``transformer_2`` and never the high-noise expert, unless its samples need both."""
    from engine.training.base_loading import load_base, load_denoisers

    base, _, _ = two_experts
    plan = _plan(base, clips, steps=2, expert="low")
    pipe = load_base(plan, torch.float32)
    assert (pipe.transformer, pipe.transformer_2) == (None, None)  # while the captions are cached
    load_denoisers(plan, pipe, torch.float32)
    assert pipe.transformer is None and isinstance(pipe.transformer_2, torch.nn.Module)
    assert not any(p.requires_grad for p in pipe.transformer_2.parameters())
    sampled = _plan(base, clips, steps=2, expert="low", sample_prompts=["a square"])
    assert sampled.loaded_denoisers == ("transformer", "transformer_2")


def test_an_a14b_one_expert_lora_fits_a_24_gb_card_at_480p(clips: Path, cli_json: Callable[..., object],
                                                           tmp_path: Path) -> None:
    """``--expert low`` holds one 14B expert, and the captions are cached before it is placed: it
    fits a 4090 at 480p and 81 frames (it was refused in every precision, both experts' weights
    counted and the caching phase sized with the 11.4 GB encoder beside them)."""
    def dry_run(*extra: str) -> dict[str, object]:
        answer = cli_json("train", "--base", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "--data", str(clips),
                          "--hardware", "rtx4090", "--resolution", "480", "--frames", "81", "--short-clips", "pad",
                          "--dry-run", "--runs-dir", str(tmp_path / "runs"), *extra)
        return answer["plan"]["memory"]["estimate"]  # type: ignore[index,return-value]

    low, both = dry_run("--expert", "low"), dry_run("--expert", "both")
    assert low["base_source"] == "table, the low-noise expert alone" and low["peak_gb"] < 23.6
    assert low["caching_peak_gb"] < 14  # the encoders and the VAE, no expert beside them
    assert both["base_gb"] > low["base_gb"]  # both experts held when both train
    alone = dry_run("--expert", "low", "--base-precision", "nf4")
    sampled = dry_run("--expert", "low", "--base-precision", "nf4", "--sample-prompt", "a fox")
    assert sampled["base_gb"] == pytest.approx(2 * alone["base_gb"], rel=0.01)  # samples render with both


@pytest.mark.slow
def test_a_two_expert_run_folder_as_a_lora_puts_each_file_on_its_expert(
    two_experts: tuple[Path, Path, dict[str, str]], tiny_pipeline: Callable[[str], Path],
) -> None:
    """``--lora RUN`` brings the run's low-noise LoRA into ``transformer_2`` (its metadata says so); on
    a one-expert model that file is refused before anything is evicted."""
    from tests.support import HostModel

    base, run, outputs = two_experts
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(base))

    def render(*loras: str) -> bytes:
        clip = engine.videos.generate("a square", frames=FRAMES, steps=2, width=SIZE, height=SIZE, seed=0,
                                      loras=list(loras) or None)
        return b"".join(frame.tobytes() for frame in clip.frames)

    plain, high_only, both = render(), render(f"{outputs['lora']}:1"), render(f"{run}:1")
    assert len({plain, high_only, both}) == 3  # the second expert's LoRA changed its own steps
    pipe = engine.images.session._pipe  # type: ignore[union-attr]
    assert len(pipe.transformer.peft_config) == 1 and len(pipe.transformer_2.peft_config) == 1
    assert render(f"{run}:0") == plain
    engine.images.unload()
    host = HostModel(engine)
    with pytest.raises(EngineError) as refused:
        engine.images.load(str(tiny_pipeline("wan")), loras=[str(Path(outputs["lora_low_noise"]).parent)])
    assert refused.value.code == "lora_mismatch" and "second expert" in refused.value.message
    assert host.evicted == 0 and engine.images.session is None


@pytest.mark.slow
def test_the_training_memory_of_a_clip_run_matches_a_real_width_step_under_fake_tensors() -> None:
    """Wan 2.1 1.3B at full width and depth, 256 px, 17 and 33 frames, gradient checkpointing:
    the estimate's activations and peak within 10% of the bytes the step holds."""
    from engine.testing import memory_figures
    from engine.testing.memory_measure import measure_step

    d = memory_figures.Denoiser.of(REGISTRY.family("wan"))
    config = memory_figures._config(d, {})
    for frames in (17, 33):
        m, extra = measure_step(d, {}, 256, d.text_tokens, True, frames=frames)
        estimate = memory_figures.estimate_for(d, config, m, extra, 256, d.text_tokens, True, frames)
        assert estimate.activations_gb == pytest.approx(m.activations_peak / 1e9, rel=0.10), frames
        assert estimate.training_peak_gb - estimate.overhead_gb == pytest.approx(m.peak / 1e9, rel=0.10), frames


# -- refusals: before anything is evicted --------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-clips")
    sets: dict[str, Path] = {}
    for name, writer in (
        ("corrupt", lambda d: (d / "cut.mp4").write_bytes(write_clip(root / "whole.mp4", 9).read_bytes()[:300])),
        ("empty_clip", lambda d: (d / "empty.mp4").write_bytes(b"")),
        ("too_short", lambda d: write_clip(d / "short.mp4", 2)),
        ("oversized", lambda d: write_clip(d / "huge.mp4", 1, (9600, 9600))),
    ):
        folder = write_dataset(root / name, count=1)
        writer(folder)
        sets[name] = folder
    sets["good"] = write_clip_dataset(root / "good", clips=1, images=0)
    return sets


@pytest.mark.slow
def test_doomed_video_training_starts_evict_nothing(
    tiny_pipeline: Callable[[str], Path], bad_clips: dict[str, Path], tmp_path: Path,
) -> None:
    """The 0-eviction matrix's video training cases: each refused at the preflight, naming the file or flag."""
    from tests.support import HostModel

    wan, sdxl = str(tiny_pipeline("wan")), str(tiny_pipeline("sdxl"))
    cases = [
        ({"dataset_dir": bad_clips["corrupt"]}, "bad_dataset", "cut.mp4"),
        ({"dataset_dir": bad_clips["empty_clip"]}, "bad_dataset", "empty.mp4"),
        ({"dataset_dir": bad_clips["too_short"]}, "short_clips", "short.mp4"),
        ({"dataset_dir": bad_clips["oversized"]}, "bad_dataset", "absurd size: 9600x9600"),
        ({"frames": 6}, "invalid_video_shape", "4k+1"),
        ({"frames": 125}, "invalid_video_shape", "5 to 121"),
        ({"expert": "low"}, "no_second_expert", "one denoiser"),
        ({"base_model": sdxl, "frames": 9}, "invalid_video_shape", "trains on images"),
    ]
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    for fields, code, words in cases:
        config = {"base_model": wan, "dataset_dir": str(bad_clips["good"]), "resolution": SIZE, "steps": 2,
                  "frames": FRAMES, "device": "cpu", **{k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}}
        config = {k: v for k, v in config.items() if v is not None}
        with pytest.raises(EngineError) as refused:
            engine.training.start(config)
        assert refused.value.code == code and words in refused.value.message, (fields, refused.value)
        assert engine.residency.owner is None and engine.status()["job"] is None
    assert host.evicted == 0
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_clip_run_that_cannot_fit_is_refused_naming_what_would(clips: Path) -> None:
    """A 1.3B run of 81 frames at 832 px without checkpointing does not fit a 4090: refused at the
    dry run (the base sized from the table, nothing downloaded), the message naming the way out."""
    config = TrainingConfig.from_data({
        "base_model": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "dataset_dir": str(clips), "resolution": 832,
        "frames": 81, "short_clips": "pad", "gradient_checkpointing": False, "base_precision": "bf16",
    })
    with pytest.raises(PreflightError) as refused:
        preflight_training(REGISTRY, config, PRESETS["rtx4090"], fetch=False)
    assert refused.value.code in ("insufficient_memory", "training_does_not_fit"), refused.value
    fits = config.model_copy(update={"frames": 17, "resolution": 480, "gradient_checkpointing": True})
    plan = preflight_training(REGISTRY, fits, PRESETS["rtx4090"], fetch=False)
    assert plan.memory is not None and plan.memory.peak_gb < 24


def test_an_int8_base_trains_a_clip_lora_on_the_cpu(tiny_pipeline: Callable[[str], Path], clips: Path,
                                                    tmp_path: Path) -> None:
    """torchao int8 on the host, block by block, before the adapter trains over it."""
    plan = _plan(tiny_pipeline("wan"), clips, steps=2, base_precision="int8")
    assert plan.base_precision.value == "int8"
    end, events = _train(plan, tmp_path / "int8")
    [started] = [e for e in events if e["type"] == "started"]
    assert started["quantised_layers"] > 0  # type: ignore[operator]
    assert any(v.abs().sum() > 0 for k, v in load_file(end["outputs"]["lora"]).items() if "lora_B" in k)  # type: ignore[index]


@pytest.mark.slow
def test_a_one_expert_dry_run_answers_json(clips: Path, tmp_path: Path, cli_json: Callable[..., object]) -> None:
    """``train --expert low --dry-run --json``: every resolved value JSON holds (the expert choice
    as its dict, asked and decided), not a crash on a record it cannot serialise."""
    from families.wan.tiny import build_tiny_two_experts

    base = build_tiny_two_experts(tmp_path / "a14b")
    plan = cli_json("train", "--base", str(base), "--data", str(clips), "--expert", "low", "--dry-run",
                    "--device", "cpu", "--resolution", str(SIZE), "--frames", str(FRAMES), "--steps", "1",
                    "--runs-dir", str(tmp_path / "runs"))
    expert = plan["plan"]["expert"]  # type: ignore[index]
    assert expert["value"]["components"] == ["transformer_2"] and expert["requested"]["expert"] == "low"


def test_an_image_family_refuses_a_folder_of_clips_before_anything_is_evicted(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    """SDXL trains on images: a folder of clips is ``clips_not_supported`` at the check (it passed
    the dry run and failed at step 0 with an unreadable image), the host's model left resident."""
    from tests.support import HostModel

    data = write_clip_dataset(tmp_path / "clips", clips=2, images=0)
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    config = {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(data), "resolution": 64,
              "steps": 1, "device": "cpu"}
    for attempt in (engine.training.plan, engine.training.start):
        with pytest.raises(PreflightError) as refused:
            attempt(config)
        assert refused.value.code == "clips_not_supported" and "clip_000.mp4" in refused.value.message
    assert host.evicted == 0 and engine.training.current is None


def test_a_bucket_that_changes_a_clips_aspect_is_named(tiny_pipeline: Callable[[str], Path], tmp_path: Path,
                                                      cli_json: Callable[..., object]) -> None:
    """A 3:2 clip trained at 64 px on TI2V's multiple of 32 lands in a 2:1 bucket: the dry run
    names it and what the crop cuts (it said nothing); a square clip that fits its bucket is not named."""
    (tmp_path / "clips").mkdir()
    write_clip(tmp_path / "clips" / "wide.mp4", frames=9, size=(96, 64))
    write_clip(tmp_path / "clips" / "square.mp4", frames=9, size=(64, 64), index=1)
    plan = cli_json("train", "--base", str(tiny_pipeline("wan")), "--data", str(tmp_path / "clips"), "--dry-run",
                    "--device", "cpu", "--resolution", str(SIZE), "--frames", str(FRAMES), "--steps", "1",
                    "--runs-dir", str(tmp_path / "runs"))
    [warning] = plan["plan"]["buckets"]["warnings"]  # type: ignore[index]
    assert warning.startswith("wide.mp4 (96x64, 1.50:1) is trained at 64x32 (2.00:1)") and "of its height is cropped" in warning
