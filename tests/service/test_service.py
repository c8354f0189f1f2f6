"""The Engine facade: doomed requests never evict; accepted ones evict once, after the checks."""

from __future__ import annotations

from engine.requests.bodies import MAX_STEPS

import io
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine import Engine
from engine.errors import EngineError
from engine.hardware.presets import PRESETS
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest
from engine.service.residency import Residency
from engine.service.facade import Busy
from engine.testing.checkpoints import write_single_file
from engine.testing.datasets import write_dataset
from engine.contract.types import TRAINING_PRECISIONS
from tests.support import escaping_dataset, truncated_pipeline
from engine.requests.training import TrainingConfig
from engine.training.records import RunRecord
from engine.training.state_file import write_state
from tests.support import HostModel
from tests.support import Planted, real_state

REGISTRY = load_registry()
FAMILIES = ["flux", "qwen_image", "zimage", "sdxl"]


@pytest.fixture(scope="module")
def fixtures_root(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> dict[str, Path]:
    """Bad bases and bad datasets, real files on disk."""
    root = tmp_path_factory.mktemp("doomed")
    good_data = write_dataset(root / "good-data", count=2)
    corrupt = write_dataset(root / "corrupt-data", count=2)
    (corrupt / "zero.png").write_bytes(b"")
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "blue").save(buffer, format="PNG")
    (corrupt / "cut.png").write_bytes(buffer.getvalue()[:40])
    empty = root / "empty-data"
    empty.mkdir()
    not_pipeline = root / "not-a-pipeline"
    not_pipeline.mkdir()
    (not_pipeline / "notes.txt").write_text("no model here", encoding="utf-8")
    single = write_single_file(tiny_pipeline("sdxl"), "unet", root / "single" / "unet.safetensors").parent
    secret = root / "outside" / "passwd"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n", encoding="utf-8")
    # Resumes: a checkpoint whose state.pt runs code when unpickled, and one of a run trained at rank 2.
    planted = root / "planted-run" / "checkpoints" / "step-00000001"
    planted.mkdir(parents=True)
    torch.save({**real_state(), "trainable": {"x": Planted(root / "pwned")}}, planted / "state.pt")
    other_rank = root / "rank-2-run" / "checkpoints" / "step-00000001"
    other_rank.mkdir(parents=True)
    write_state(other_rank, real_state())
    config = TrainingConfig(base_model=str(tiny_pipeline("sdxl")), dataset_dir=good_data, lora_rank=2)
    RunRecord(run_id="rank-2-run", folder=other_rank.parent.parent, family="sdxl", base_model=config.base_model,
              config=config.public_dict(), plan={}, status="completed").save()
    truncated = {
        f"truncated_{family}": truncated_pipeline(tiny_pipeline(family), root / f"cut-{family}", REGISTRY.family(family).pipeline.denoiser)
        for family in FAMILIES
    }
    return {
        "good_data": good_data, "corrupt_data": corrupt, "empty_data": empty,
        "missing_data": root / "no-such-data", "not_pipeline": not_pipeline,
        "missing_base": root / "no-such-base", "single_file": single,
        "linked_image_data": escaping_dataset(root / "linked-image-data", secret, "passwd.png"),
        "linked_caption_data": escaping_dataset(root / "linked-caption-data", secret, "image_000.txt"),
        "planted_checkpoint": planted, "rank_2_checkpoint": other_rank, "pwned": root / "pwned",
        **truncated,
    }


def _bases(fx: dict[str, Path], tiny: Callable[[str], Path], family: str) -> dict[str, Path]:
    other = FAMILIES[(FAMILIES.index(family) + 1) % len(FAMILIES)]
    return {"good": tiny(family), "not_pipeline": fx["not_pipeline"], "missing": fx["missing_base"],
            "single_file": fx["single_file"], "truncated": fx[f"truncated_{family}"],
            "other_family": tiny(other)}  # its model_index.json names another family than the forced one


def doomed_cases(fx: dict[str, Path], tiny: Callable[[str], Path]) -> list[tuple[str, str, dict[str, object]]]:
    """(preset, label, config): every one of these is doomed somewhere in the preflight."""
    cases: list[tuple[str, str, dict[str, object]]] = []
    bad_data = ("corrupt_data", "empty_data", "missing_data", "linked_image_data", "linked_caption_data")
    for preset, family, precision in itertools.product(sorted(PRESETS), FAMILIES, (*TRAINING_PRECISIONS, "int4")):
        bases = _bases(fx, tiny, family)
        for base_kind in ("not_pipeline", "missing", "single_file", "truncated", "other_family"):
            cases.append((preset, f"{family}/{precision}/base={base_kind}", {
                "base_model": str(bases[base_kind]), "family": family, "dataset_dir": str(fx["good_data"]),
                "base_precision": precision, "resolution": 64, "steps": 2,
            }))
        for data_kind in bad_data:
            cases.append((preset, f"{family}/{precision}/data={data_kind}", {
                "base_model": str(bases["good"]), "family": family, "dataset_dir": str(fx[data_kind]),
                "base_precision": precision, "resolution": 64, "steps": 2,
            }))
    good = {"base_model": str(tiny("sdxl")), "dataset_dir": str(fx["good_data"])}
    for bad in ({"resolution": 100}, {"steps": 0}, {"epochs": "three"}, {"learning_rate": -1},
                {"steps": 5, "epochs": 2}, {"lora_rank": 0}, {"device": "tpu"}, {"unknown": 1},
                {"mixed_precision": "fp8"}, {"family": "sd15"},
                {"seed": 2**70}, {"lora_rank": 10**10}, {"batch_size": 10**6}, {"steps": 10**12},
                {"learning_rate": float("inf")}, {"base_model": ""}, {"base_model": "./nope"},
                {"base_model": "/data/x/no-such-model"}, {"base_model": "nope"},
                {"base_model": "someone-offline/FLUX.1-dev-not-downloaded"},
                {"lora_targets": ["no_such_proj"]}, {"lora_targets": ["norm"]},
                {"base_model": str(tiny("flux")), "family": "sdxl"},
                {"base_model": str(fx["truncated_sdxl"])}, {"resume_from": str(fx["planted_checkpoint"])},
                {"resume_from": str(fx["rank_2_checkpoint"])}, {"resume_from": str(fx["good_data"])}):
        cases.append(("h100", f"config={bad}", {**good, **bad}))
    return cases


@pytest.mark.slow
def test_five_hundred_doomed_training_starts_evict_nothing(
    fixtures_root: dict[str, Path], tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    cases = doomed_cases(fixtures_root, tiny_pipeline)
    assert len(cases) >= 500
    engines = {name: Engine(registry=REGISTRY, hardware=hw, runs_dir=tmp_path) for name, hw in PRESETS.items()}
    hosts = {name: HostModel(engine) for name, engine in engines.items()}
    codes: dict[str, int] = {}
    for preset, label, config in cases:
        engine = engines[preset]
        with pytest.raises(EngineError) as raised:
            engine.training.start(config)
        code = raised.value.code
        codes[code] = codes.get(code, 0) + 1
        assert engine.residency.owner is None, (preset, label)
        assert engine.status()["job"] is None, (preset, label)
        if "data=" in label and raised.value.code in ("bad_dataset", "empty_dataset", "dataset_not_found", "path_outside_root"):
            assert label.endswith(("corrupt_data", "empty_data", "missing_data", "linked_image_data", "linked_caption_data"))
    assert all(host.evicted == 0 for host in hosts.values())
    assert not list(tmp_path.iterdir()), "no run folder was created for a refused start"
    assert not fixtures_root["pwned"].exists(), "a planted checkpoint ran"
    # Every stage of the preflight refused something.
    for expected in ("no_native_bf16", "needs_cuda", "quant_denied", "invalid_base_precision", "not_a_pipeline",
                     "model_not_found", "bad_dataset", "empty_dataset", "dataset_not_found", "invalid_config",
                     "fp8_unsupported", "mxfp8_unsupported", "unknown_family", "path_outside_root",
                     "corrupt_checkpoint", "family_mismatch", "unknown_lora_target", "hub_offline",
                     "checkpoint_unreadable", "resume_mismatch"):
        assert codes.get(expected), (expected, codes)


def test_doomed_loads_evict_nothing(fixtures_root: dict[str, Path], tiny_pipeline: Callable[[str], Path]) -> None:
    t4 = Engine(registry=REGISTRY, hardware=PRESETS["t4"])
    host = HostModel(t4)
    doomed = [
        (lambda: t4.images.load(str(fixtures_root["not_pipeline"])), "not_a_pipeline"),
        (lambda: t4.images.load(str(fixtures_root["missing_base"])), "model_not_found"),
        (lambda: t4.images.load(str(tiny_pipeline("qwen_image")), request=InferenceRequest(dtype="fp16")), "fp16_unsafe"),
        (lambda: t4.images.load(str(tiny_pipeline("sdxl")), request=InferenceRequest(quant="int9")), "invalid_request"),
        (lambda: t4.images.load(str(tiny_pipeline("flux")), request=InferenceRequest(dtype="bf16")), "bf16_unsupported"),
        (lambda: t4.images.load(str(tiny_pipeline("zimage")), request=InferenceRequest(dtype="fp16")), "fp16_unsafe"),
        (lambda: t4.images.load(str(tiny_pipeline("sdxl")), request=InferenceRequest(speed="warp")), "invalid_request"),
        (lambda: t4.images.load(str(fixtures_root["truncated_sdxl"])), "corrupt_checkpoint"),
        (lambda: t4.images.load(""), "invalid_request"),
        (lambda: t4.images.load("./nope"), "model_not_found"),
        (lambda: t4.images.load("/data/x/no-such-model"), "model_not_found"),
        (lambda: t4.images.load("someone-offline/FLUX.1-dev-not-downloaded"), "hub_offline"),
        (lambda: t4.images.load(str(tiny_pipeline("flux")), family="sdxl"), "family_mismatch"),
    ]
    for attempt, code in doomed:
        with pytest.raises(EngineError) as raised:
            attempt()
        assert raised.value.code == code
    assert host.evicted == 0 and t4.residency.owner is None


@pytest.mark.slow
def test_accepted_training_evicts_exactly_once_after_the_checks_one_of_two_racing_starts_runs_and_releases(
    fixtures_root: dict[str, Path], tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path)
    host = HostModel(engine)
    config = {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(fixtures_root["good_data"]),
              "resolution": 64, "steps": 2, "lora_rank": 2, "device": "cpu"}
    # Two starts at once: exactly one runs, and the other is told the engine is busy.
    outcomes: list[object] = []
    barrier = threading.Barrier(2)

    def start() -> None:
        barrier.wait()
        try:
            outcomes.append(engine.training.start(config))
        except Busy:
            outcomes.append("busy")

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [started] = [o for o in outcomes if o != "busy"]
    assert outcomes.count("busy") == 1
    assert host.evicted == 1 and engine.residency.owner == "engine.trainer"
    with pytest.raises(Busy):
        engine.training.start(config)  # one run at a time
    with pytest.raises(Busy):
        engine.images.load(str(tiny_pipeline("sdxl")))  # no load while training
    record = engine.training.wait(timeout=300)
    assert record.status == "completed" and record.run_id == started["run_id"]
    assert engine.residency.owner is None and engine.status()["job"] is None
    assert host.evicted == 1


@pytest.mark.slow
def test_loading_a_pipeline_evicts_the_host_model_once_and_generates(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    host = HostModel(engine)
    status = engine.images.load(str(tiny_pipeline("zimage")))
    assert status["loaded"] and host.evicted == 1 and engine.residency.owner == "engine.pipeline"
    steps: list[tuple[int, int]] = []
    [image] = engine.images.generate("a fox", steps=2, width=64, height=64, progress=lambda s, t: steps.append((s, t)))
    assert image.size == (64, 64) and steps == [(1, 2), (2, 2)]
    assert engine.images.unload() and engine.residency.owner is None


def test_residency_release_if_never_releases_a_newer_owner() -> None:
    residency = Residency()
    residency.acquire("engine.trainer")
    assert not residency.release_if(lambda owner: owner == "engine.pipeline")
    assert residency.owner == "engine.trainer"
    assert residency.release_if(lambda owner: owner == "engine.trainer") and residency.owner is None


def test_engine_import_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, engine; engine.Engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_imports_only_what_it_answers_with() -> None:
    """``--version`` cost 0.32 CPU-s (316 modules: the request models, pydantic) against 3.3 for
    ``import torch``; it now answers from the package's version alone (bench/info_latency.py
    measures about 1/100 of the torch import)."""
    import subprocess
    import sys

    code = ("import sys\nfrom engine.cli import main\nmain(['--version'])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'torch', 'PIL', 'numpy'}),"
            " len([m for m in sys.modules if m.startswith('engine')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    version, heavy = out.stdout.strip().splitlines()
    assert version.startswith("diffusion-engine ") and heavy.split()[0] == "[]", out.stdout
    assert int(heavy.split()[-1]) <= 4, out.stdout  # engine, its version, engine.cli and its start clock


@pytest.mark.slow
def test_two_engines_in_one_process_share_one_gpu_arbiter(tiny_pipeline: Callable[[str], Path]) -> None:
    """One process, one GPU: a second Engine's load evicts the first's idle pipeline (and the
    host's model registered with it), and is refused while the first is using the GPU."""
    first = Engine(registry=REGISTRY, hardware=probe(verify=False))
    second = Engine(registry=REGISTRY, hardware=probe(verify=False))
    host = HostModel(first, size_gb=0.0)
    first.images.load(str(tiny_pipeline("sdxl")))
    assert host.evicted == 1
    running = threading.Event()

    def generate() -> None:
        try:
            first.images.generate("a fox", steps=MAX_STEPS, width=64, height=64, progress=lambda s, t: running.set())
        except EngineError as exc:
            assert exc.code == "cancelled"

    thread = threading.Thread(target=generate)
    thread.start()
    assert running.wait(120)
    with pytest.raises(Busy, match="another Engine in this process"):
        second.images.load(str(tiny_pipeline("sdxl")))
    first.images.cancel()
    thread.join(120)
    assert first.status()["pipeline"] is not None  # the refused load took nothing from it
    second.images.load(str(tiny_pipeline("sdxl")))
    assert first.status()["pipeline"] is None and second.status()["pipeline"] is not None
    assert host.evicted == 2
    with pytest.raises(EngineError) as refused:
        first.images.generate("a fox", steps=1, width=64, height=64)
    assert refused.value.code == "not_loaded"
    assert second.images.unload()
