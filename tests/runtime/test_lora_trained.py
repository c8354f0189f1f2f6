"""What the trainer writes, used: a real (one-step) LoRA of every family through ``generate``.

Each family's LoRA is trained by the engine's own trainer on its tiny
pipeline (rank 4, alpha 8: alpha != rank, so a loader that lost the alpha
would apply it at half strength), then given to the CLI as the run folder.
``generate --tiny F`` builds the same tiny pipeline the run trained on (the
builds are seeded, byte for byte identical), so the reference is stock
diffusers' ``load_lora_weights`` on that pipeline, same seed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from engine.cli import main
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.lora import RUN_LORA_FILE, LoraChoice, plan_input, read_loras
from engine.preflight.model import resolve_model
from engine.runtime.session import GenerateRequest, InferenceSession

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
FAMILIES = ["flux", "qwen_image", "zimage", "sdxl"]
RANK, ALPHA = 4, 8.0
#: 64 px: the smallest size both training and generate take.
PROMPT, SEED, STEPS, SIZE = "a lighthouse at dusk", 3, 2, 64
#: The family whose run also renders a sample in the trainer (its in-memory
#: adapted model) and exports the kohya / ComfyUI file.
SAMPLED = "zimage"


@pytest.fixture(scope="module")
def trained(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``trained(family)``: the folder of a real one-step training run on the family's tiny pipeline."""
    from engine.testing.datasets import write_dataset
    from engine.requests.training import TrainingConfig
    from engine.training.preflight import preflight_training
    from engine.training.trainer import run_training

    data = write_dataset(tmp_path_factory.mktemp("lora-data"), count=1, size=SIZE)
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            fields: dict[str, object] = {
                "base_model": str(tiny_pipeline(family)), "dataset_dir": str(data), "resolution": SIZE,
                "steps": 1, "lora_rank": RANK, "lora_alpha": ALPHA, "learning_rate": 0.1,
                "warmup_steps": 0,  # the one step at the full rate: a visible change
                "device": "cpu", "seed": SEED,
            }
            if family == SAMPLED:  # the sample is rendered by the trainer's own adapted pipeline
                fields.update(sample_prompts=[PROMPT], sample_every=1, sample_steps=STEPS, export_kohya=True)
            plan = preflight_training(REGISTRY, TrainingConfig.from_data(fields), HARDWARE)
            folder = tmp_path_factory.mktemp(f"run-{family}")
            result = run_training(plan, folder, lambda _event: None, lambda: None)
            assert result["type"] == "completed", result
            runs[family] = folder
        return runs[family]

    return get


def cli_image(family: str, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[np.ndarray, dict]:
    """``generate --tiny FAMILY`` at the test's seed and size: (image, the --json report)."""
    capsys.readouterr()
    code = main([
        "generate", "--tiny", family, "--prompt", PROMPT, "-o", str(out), "--seed", str(SEED),
        "--steps", str(STEPS), "--width", str(SIZE), "--height", str(SIZE), "--json", *extra,
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    with Image.open(out) as written:
        return _pixels(written.convert("RGB")), report


def engine_session(folder: Path, loras: tuple = (), *, switching: bool = False, dtype: str = "auto") -> InferenceSession:
    source = resolve_model(REGISTRY, folder)
    request = InferenceRequest(loras=plan_input(loras, switching=switching), dtype=dtype)
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request),
                               request, loras=loras)
    session.load()
    return session


def render(session: InferenceSession) -> np.ndarray:
    [result] = session.generate(GenerateRequest(PROMPT, steps=STEPS, seed=SEED, width=SIZE, height=SIZE))
    return _pixels(result)


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(np.float64) / 255.0


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, atol=1e-5, rtol=0))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_trained_lora_in_generate_changes_the_image_and_equals_stock_diffusers(
    family: str, tiny_pipeline: Callable[[str], Path], trained: Callable[[str], Path],
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    run = trained(family)
    with_lora, report = cli_image(family, tmp_path / "lora.png", capsys, "--lora", str(run))
    at_zero, _ = cli_image(family, tmp_path / "zero.png", capsys, "--lora", f"{run}:0")
    mode = report["status"]["plan"]["resolved"]["lora"]["value"]
    assert report["status"]["loras"]["applied"][0]["path"] == str((run / RUN_LORA_FILE).resolve())

    stock = engine_session(tiny_pipeline(family))  # no LoRA: the engine's pipeline, then diffusers' loader
    try:
        plain = render(stock)
        stock.pipeline.load_lora_weights(str(run / RUN_LORA_FILE))
        if mode == "fused":  # one LoRA on a dense base: merged, as the plan chose
            stock.pipeline.fuse_lora(components=[REGISTRY.family(family).pipeline.denoiser])
        reference = render(stock)
    finally:
        stock.unload()
    assert mode in ("fused", "unfused")
    assert np.abs(with_lora - plain).mean() > 1e-3, "the trained LoRA changes the image"
    assert same(with_lora, reference), "generate --lora equals diffusers' load_lora_weights"
    assert same(at_zero, plain), "scale 0 is the image without the LoRA"


@pytest.mark.slow
def test_both_files_of_a_run_keep_its_alpha_and_render_what_the_trainer_had(
    tiny_pipeline: Callable[[str], Path], trained: Callable[[str], Path]
) -> None:
    """alpha 8 over rank 4. The diffusers file carries the adapter config and
    the kohya file its ``.alpha`` keys and ``ss_*`` metadata; through the
    engine both give one image (1e-5), equal to the sample the trainer
    rendered with the adapter in memory.

    Two pipelines (the trainer's, with its pinned attention kernel, and the
    engine's) may round a pixel differently, so "equal" to the sample is
    within one 8-bit level; the file read as alpha == rank (what a loader
    assumes without the config) misses by several levels on average."""
    from engine.training.export import KOHYA_FILE

    run = trained(SAMPLED)
    with safe_open(str(run / RUN_LORA_FILE), "pt") as handle:
        config = json.loads(handle.metadata()["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (RANK, ALPHA)
    with safe_open(str(run / KOHYA_FILE), "pt") as handle:
        meta = handle.metadata()
        alphas = {float(handle.get_tensor(k)) for k in handle.keys() if k.endswith(".alpha")}
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], alphas) == (str(RANK), str(ALPHA), {ALPHA})
    assert meta["ss_resolution"] == f"({SIZE}, {SIZE})" and meta["ss_max_train_steps"] == "1"
    assert meta["ss_sd_model_name"] == tiny_pipeline(SAMPLED).name and json.loads(meta["ss_network_args"])
    [sample] = sorted((run / "samples").glob("*.png"))
    with Image.open(sample) as written:
        in_memory = _pixels(written.convert("RGB"))
    # fp32, as the trainer rendered its sample on this CPU
    session = engine_session(tiny_pipeline(SAMPLED), read_loras([LoraChoice(str(run))]), switching=True, dtype="fp32")
    try:
        assert session.plan.value("lora") == "unfused"
        through_engine = render(session)
        session.set_loras(read_loras([LoraChoice(str(run / KOHYA_FILE))]))
        from_kohya = render(session)
    finally:
        session.unload()
    assert same(from_kohya, through_engine), "the kohya file gives the diffusers file's image"
    assert np.abs(through_engine - in_memory).max() <= 1 / 255 + 1e-9
    assert np.abs(through_engine - in_memory).mean() < 1e-3


@pytest.mark.slow
def test_generate_refuses_a_trained_lora_of_another_family_before_loading_anything(
    trained: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real FLUX.1 run given to an SDXL generate: exit 2, naming the family it
    looks like, with no pipeline loaded (so nothing was evicted) and no file written."""
    loads: list[str] = []
    monkeypatch.setattr(InferenceSession, "_load_pipeline", lambda self, *_a, **_k: loads.append("base"))
    out = tmp_path / "refused.png"
    capsys.readouterr()
    code = main(["generate", "--tiny", "sdxl", "--lora", str(trained("flux")), "--prompt", PROMPT, "-o", str(out),
                 "--steps", str(STEPS), "--width", str(SIZE), "--height", str(SIZE)])
    error = capsys.readouterr().err
    assert code == 2 and loads == [] and not out.exists()
    assert "error[lora_mismatch]" in error and "FLUX.1" in error and "match nothing" in error
