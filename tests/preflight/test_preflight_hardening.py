"""Every check before eviction: confinement by real paths, model path truths,
bounded configs, complete checkpoints, a wedge-free GPU arbiter, one GPU job at a time.

Real files (tiny real pipelines, real symlinks, a real FIFO), the real Engine
and a real loopback server; only the hardware is a preset where a rule is
about a GPU this machine lacks.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine import Engine
from engine.errors import EngineError
from engine.hardware.presets import PRESETS, preset
from engine.policy.training import training_precision_preflight_error
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.preflight.dataset import DatasetError, discover_dataset
from engine.preflight.model import is_hub_id, looks_like_path, resolve_model
from engine.service.residency import Residency, Resident
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Busy
from engine.testing.datasets import write_dataset
from engine.requests.training import InvalidConfig, TrainingConfig
from engine.training.preflight import preflight_training
from engine.contract.types import model_name
from tests.support import HostModel, LiveServer, escaping_dataset, linked_pipeline, truncated_pipeline

REGISTRY = load_registry()


# -- helpers shared with the doomed matrix in test_service.py -----------------------


#: Call lists of the armed :func:`no_hub` fixtures (the innermost records).
_HUB_GUARDS: list[list[str]] = []
_HUB_FUNCTIONS = ("hf_hub_download", "snapshot_download", "try_to_load_from_cache", "model_info", "file_exists")


def _hub_guard(name: str, original: Callable[..., object]) -> Callable[..., object]:
    """``original`` that fails the test while a guard is armed, and passes through
    otherwise: a module that imports the name while the guard is in place and
    keeps it works normally once the test is over."""

    @functools.wraps(original)
    def call(*args: object, **kwargs: object) -> object:
        if _HUB_GUARDS:
            _HUB_GUARDS[-1].append(name)
            raise AssertionError(f"huggingface_hub.{name} was called: {args} {kwargs}")
        return original(*args, **kwargs)

    return call


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail loudly if anything asks the hub (network or cache) for a file, through
    huggingface_hub or a module that already imported its functions."""
    import huggingface_hub

    for name in _HUB_FUNCTIONS:
        original = getattr(huggingface_hub, name)
        guard = _hub_guard(name, original)
        for module in list(sys.modules.values()):
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, guard)
    calls: list[str] = []
    _HUB_GUARDS.append(calls)
    try:
        yield calls
    finally:
        _HUB_GUARDS.remove(calls)


# -- 1. dataset files are confined by their real paths --------------------------------


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text("root:x:0:0:secret line\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("link", ["passwd.png", "image_000.txt", "metadata.jsonl", "sub/deep.png"])
def test_a_symlink_leading_out_of_the_dataset_refuses_it_naming_the_file(tmp_path: Path, secret: Path, link: str) -> None:
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    escaping_dataset(folder, secret, link)
    with pytest.raises(DatasetError) as raised:
        discover_dataset(folder)
    assert raised.value.code == "path_outside_root"
    assert link in raised.value.message and "secret" not in raised.value.message
    assert [name for name, _ in raised.value.problems] == [link]


def test_a_real_png_outside_is_refused_too_and_a_folder_link_out_as_well(tmp_path: Path) -> None:
    outside = write_dataset(tmp_path / "elsewhere", count=1)
    folder = write_dataset(tmp_path / "data", count=1)
    (folder / "stolen.png").symlink_to(outside / "image_000.png")
    (folder / "more").symlink_to(outside)
    with pytest.raises(DatasetError) as raised:
        discover_dataset(folder)
    assert sorted(name for name, _ in raised.value.problems) == ["more", "stolen.png"]


def test_links_inside_the_root_are_fine_and_a_linked_root_works(tmp_path: Path) -> None:
    folder = write_dataset(tmp_path / "data", count=2)
    (folder / "alias.png").symlink_to(folder / "image_000.png")
    (folder / "alias.txt").write_text("same picture, own caption", encoding="utf-8")
    (folder / "loop").symlink_to(folder)  # a folder link is never followed: no loop
    root_link = tmp_path / "data-link"
    root_link.symlink_to(folder)
    report = discover_dataset(root_link)
    assert [i.relative for i in report.items] == ["alias.png", "image_000.png", "image_001.png"]
    assert report.items[0].caption == "same picture, own caption"
    assert report.items[0].image == (folder / "image_000.png").resolve()  # the file that was checked
    assert ("loop", "a symlink to a folder (not followed)") in report.skipped


def test_a_fifo_is_skipped_not_opened(tmp_path: Path) -> None:
    folder = write_dataset(tmp_path / "data", count=1)
    os.mkfifo(folder / "pipe.png")  # opening it would block forever
    report = discover_dataset(folder)
    assert [i.relative for i in report.items] == ["image_000.png"]
    assert ("pipe.png", "not a regular file") in report.skipped


# -- 2 and 3. model path truths ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path_like", "hub_like"),
    [
        ("black-forest-labs/FLUX.1-dev", False, True),
        ("Qwen/Qwen-Image", False, True),
        ("./nope", True, False),
        ("../models/x", True, False),
        ("/data/x", True, False),
        ("~/models/flux", True, False),
        ("nope", True, False),
        ("models/flux/dev", True, False),
        ("org/..", True, False),
        ("org/./x", True, False),
        ("org//x", True, False),
        ("org\\name", True, False),
    ],
)
def test_what_is_written_as_a_path_is_never_a_hub_id(text: str, path_like: bool, hub_like: bool) -> None:
    assert looks_like_path(text) is path_like
    assert is_hub_id(text) is hub_like


@pytest.mark.parametrize("model", ["./nope", "../nope/x", "/data/x/missing-model", "nope", "a/b/c", "~/no-such-model"])
def test_a_missing_path_is_model_not_found_with_no_hub_call(model: str, no_hub: list[str]) -> None:
    with pytest.raises(EngineError) as raised:
        resolve_model(REGISTRY, model)
    assert raised.value.code == "model_not_found" and not no_hub


def test_a_missing_base_refuses_the_start_with_no_eviction_and_no_hub_call(
    tmp_path: Path, no_hub: list[str]
) -> None:
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"], runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    data = write_dataset(tmp_path / "data", count=1)
    for base in ("./nope", "/data/x/missing-model"):
        with pytest.raises(EngineError) as raised:
            engine.training.start({"base_model": base, "dataset_dir": str(data), "device": "cuda"})
        assert raised.value.code == "model_not_found"
    for model in ("./nope", ""):
        with pytest.raises(EngineError) as refused:
            engine.images.load(model)
        assert refused.value.code == ("model_not_found" if model else "invalid_request")
    assert host.evicted == 0 and engine.residency.owner is None and not no_hub


def test_a_single_file_base_is_a_pipeline_folder_or_a_hub_id(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path], no_hub: list[str]
) -> None:
    from engine.testing.checkpoints import write_single_file

    single = write_single_file(tiny_pipeline("sdxl"), "unet", tmp_path / "single" / "unet.safetensors")
    empty = tmp_path / "empty-base"
    empty.mkdir()
    for base, code in (("./nope", "model_not_found"), (str(tmp_path / "no-such-base"), "model_not_found"),
                       (str(empty), "not_a_pipeline")):
        with pytest.raises(EngineError) as raised:
            resolve_model(REGISTRY, single, base=base)
        assert raised.value.code == code and base in raised.value.message
    assert resolve_model(REGISTRY, single, base=str(tiny_pipeline("sdxl"))).kind == "single_file"
    assert not no_hub


def test_a_folder_without_model_index_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "just-a-folder"
    folder.mkdir()
    (folder / "README.md").write_text("weights elsewhere", encoding="utf-8")
    config = TrainingConfig.from_data({"base_model": str(folder), "dataset_dir": str(tmp_path), "device": "cuda"})
    with pytest.raises(EngineError) as raised:
        preflight_training(REGISTRY, config, PRESETS["h100"])
    assert raised.value.code == "not_a_pipeline" and str(folder) in raised.value.message


def test_hub_ids_are_refused_when_not_allowed_and_offline_before_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineError) as refused:
        resolve_model(REGISTRY, "black-forest-labs/FLUX.1-dev", allow_hub=False)
    assert refused.value.code == "hub_not_allowed"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"])
    host = HostModel(engine)
    with pytest.raises(EngineError) as offline:
        engine.images.load("someone-offline/FLUX.1-dev-not-downloaded")
    assert offline.value.code == "hub_offline"
    assert "download" in offline.value.message and "local folder" in offline.value.message
    assert host.evicted == 0 and engine.residency.owner is None


def test_a_download_needs_consent_from_the_engine_for_every_face(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hub model missing from the cache is a download of many GB: without
    consent the engine refuses it (load, training plan and start) before
    anything is evicted, and the CLI gives the same refusal; the hub is never asked."""
    from engine.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("DIFFUSION_ENGINE_ALLOW_DOWNLOAD", raising=False)
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"], allow_download=False, runs_dir=tmp_path)
    host = HostModel(engine)
    import huggingface_hub

    def no_network(*_args: object, **_kwargs: object) -> None:
        pytest.fail("the hub was asked before consent")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    repo = "someone-else/FLUX.1-dev-not-downloaded"
    with pytest.raises(EngineError) as refused:
        engine.images.load(repo)
    assert refused.value.code == "download_not_allowed" and "--allow-download" in refused.value.message
    config = {"base_model": repo, "dataset_dir": str(write_dataset(tmp_path / "data", count=1)),
              "output_dir": str(tmp_path / "out")}
    with pytest.raises(EngineError) as refused:
        engine.training.start(config)
    assert refused.value.code == "download_not_allowed"
    # A dry run downloads nothing, so it needs no consent: it sizes the base from the family's
    # table and says the weights are not here, and what a start would fetch.
    weights = engine.training.plan(config).weights
    assert weights is not None and weights["here"] is False and weights["repo"] == repo
    assert "--allow-download" in str(weights["note"])
    assert main(["generate", "--model", repo, "--prompt", "x"]) == 2
    assert "error[download_not_allowed]" in capsys.readouterr().err
    assert host.evicted == 0 and engine.residency.owner is None


def test_pre_quantised_is_read_from_the_models_own_name() -> None:
    flux = REGISTRY.family("flux")
    assert model_name("/data/checkpoint4/flux-dev") == "flux-dev"
    assert model_name("someone/FLUX.1-dev-nf4") == "FLUX.1-dev-nf4"
    assert not flux.is_prequantised("/data/checkpoint4/flux-dev")
    assert REGISTRY.dense_base(flux, "/data/checkpoint4/flux-dev") is None
    assert flux.is_prequantised("/data/plain/FLUX.1-dev-nf4")
    assert REGISTRY.dense_base(flux, "someone/FLUX.1-dev-nf4") == "black-forest-labs/FLUX.1-dev"


def test_a_dense_pipeline_under_checkpoint4_trains_in_bf16_where_bf16_fits(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    base = linked_pipeline(tiny_pipeline("flux"), tmp_path / "checkpoint4" / "flux-dev")
    assert resolve_model(REGISTRY, base).prequantised_scheme is None
    data = write_dataset(tmp_path / "data", count=1)
    config = TrainingConfig.from_data(
        {"base_model": str(base), "dataset_dir": str(data), "device": "cuda", "resolution": 64, "steps": 2}
    )
    plan = preflight_training(REGISTRY, config, PRESETS["h100"])
    assert plan.base_precision.value == "bf16" and plan.base_precision.source == "auto"
    explicit = TrainingConfig.from_data({**config.public_dict(), "base_precision": "bf16"})
    assert preflight_training(REGISTRY, explicit, PRESETS["h100"]).base_precision.value == "bf16"


# -- 4. bounded configs, family agreement, LoRA targets, complete checkpoints ---------------


@pytest.mark.parametrize(
    "bad",
    [
        {"seed": 2**70}, {"seed": -1}, {"lora_rank": 10**10}, {"lora_rank": 0}, {"batch_size": 65},
        {"batch_size": 10**6}, {"steps": 10**9}, {"epochs": 10**7}, {"grad_accumulation": 10**6},
        {"learning_rate": 0}, {"learning_rate": float("inf")}, {"learning_rate": float("nan")},
        {"learning_rate": 50}, {"warmup_steps": 10**9}, {"lora_alpha": 1e12}, {"max_grad_norm": float("inf")},
        {"metric_history": 10**9}, {"resolution": 10**6}, {"base_model": ""}, {"base_model": "   "},
        {"lora_targets": []}, {"lora_targets": [""]}, {"family": ""},
    ],
)
def test_every_numeric_field_is_bounded(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidConfig) as raised:
        TrainingConfig.from_data({"base_model": "m", "dataset_dir": "d", **bad})
    assert next(iter(bad)) in raised.value.message


def test_the_bounds_themselves_are_accepted() -> None:
    config = TrainingConfig.from_data(
        {"base_model": "m", "dataset_dir": "d", "seed": 2**63 - 1, "lora_rank": 1024, "batch_size": 64,
         "steps": 1_000_000, "learning_rate": 1.0}
    )
    assert (config.seed, config.lora_rank, config.batch_size) == (2**63 - 1, 1024, 64)


def test_a_forced_family_must_agree_with_model_index(tiny_pipeline: Callable[[str], Path]) -> None:
    with pytest.raises(EngineError) as raised:
        resolve_model(REGISTRY, tiny_pipeline("flux"), family="sdxl")
    assert raised.value.code == "family_mismatch" and "flux" in raised.value.message
    assert resolve_model(REGISTRY, tiny_pipeline("flux"), family="flux").family.name == "flux"


def test_lora_targets_must_name_layers_of_the_denoiser(tmp_path: Path, tiny_pipeline: Callable[[str], Path]) -> None:
    data = write_dataset(tmp_path / "data", count=1)
    good = {"base_model": str(tiny_pipeline("zimage")), "dataset_dir": str(data), "device": "cuda", "resolution": 64}
    for targets in (["to_q", "attention.to_k"], ["to_out.0"]):
        plan = preflight_training(REGISTRY, TrainingConfig.from_data({**good, "lora_targets": targets}), PRESETS["h100"])
        assert plan.lora_targets == tuple(targets)
    for targets in (["to_q", "no_such_proj"], ["norm_q"]):  # norm_q: a 1-D weight, not adaptable
        with pytest.raises(EngineError) as raised:
            preflight_training(REGISTRY, TrainingConfig.from_data({**good, "lora_targets": targets}), PRESETS["h100"])
        assert raised.value.code == "unknown_lora_target" and targets[-1] in raised.value.message


def _write_safetensors(path: Path, header: dict[str, object], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 24, "padded"),
        ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, b"\0" * 16, "does not fill"),
        ({"w": {"dtype": "F32", "shape": [2, 2]}}, b"\0" * 16, "data_offsets"),
        # Each part of an entry checked: a true is no dimension, offsets run forwards from 0.
        ({"w": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b"", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [False, 1]}}, b"\0", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"\0", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}, b"\0", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0", "no valid shape"),
        ({"w": {"dtype": "U8", "shape": "1", "data_offsets": [0, 1]}}, b"\0", "no valid shape"),
        ({"w": [1]}, b"", "no valid shape"),
        ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 1]}}, b"\0\0", "padded"),
        (["not", "an", "object"], b"", "JSON object"),
    ],
)
def test_incomplete_safetensors_are_corrupt(tmp_path: Path, header: object, data: bytes, why: str) -> None:
    file = _write_safetensors(tmp_path / "model.safetensors", header, data)  # type: ignore[arg-type]
    with pytest.raises(EngineError) as raised:
        resolve_model(REGISTRY, file, family="flux")
    assert raised.value.code == "corrupt_checkpoint" and why in raised.value.message


def test_a_header_that_runs_past_the_file_is_corrupt(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(EngineError) as raised:
        resolve_model(REGISTRY, file, family="flux")
    assert raised.value.code == "corrupt_checkpoint" and "past the end" in raised.value.message


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder"])
def test_a_truncated_component_refuses_load_and_training_before_eviction(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path], component: str
) -> None:
    base = truncated_pipeline(tiny_pipeline("zimage"), tmp_path / "cut", component)
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"], runs_dir=tmp_path / "runs")
    host = HostModel(engine)
    with pytest.raises(EngineError) as load:
        engine.images.load(str(base))
    with pytest.raises(EngineError) as train:
        engine.training.start({"base_model": str(base), "dataset_dir": str(write_dataset(tmp_path / "d", count=1))})
    for raised in (load, train):
        assert raised.value.code == "corrupt_checkpoint" and component in raised.value.message
    assert host.evicted == 0 and engine.residency.owner is None


def test_sdxl_ignores_a_leftover_base_precision_with_a_note(tmp_path: Path, tiny_pipeline: Callable[[str], Path]) -> None:
    """The earlier system's rule: a leftover base_precision (a config reused from a DiT run)
    must never fail an SDXL run; its trainer holds the UNet in the training dtype, so the value
    is ignored, and the plan says so beside what was asked."""
    data = write_dataset(tmp_path / "data", count=1)
    good = {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(data), "resolution": 64}
    plan = preflight_training(REGISTRY, TrainingConfig.from_data({**good, "base_precision": "nf4"}), PRESETS["h100"])
    assert plan.base_precision.value == "none" and plan.base_precision.requested == "nf4"
    assert "base_precision=nf4 is ignored" in plan.base_precision.reason
    plan = preflight_training(REGISTRY, TrainingConfig.from_data(good), PRESETS["h100"])
    assert plan.base_precision.value == "none" and "ignored" not in plan.base_precision.reason


# -- 5. residency: a failing evict callback never wedges the engine -----------------------


def test_a_failing_evict_is_reported_and_the_resident_dropped() -> None:
    residency = Residency()

    def broken() -> None:
        raise RuntimeError("driver says no")

    residency.register(Resident("host.broken", broken))
    with pytest.raises(EngineError) as raised:
        residency.acquire("engine.trainer")
    assert raised.value.code == "evict_failed" and "host.broken" in raised.value.message
    assert residency.owner is None and residency.residents() == []
    assert residency.acquire("engine.trainer") == []  # the next job runs
    assert residency.release_if(lambda owner: owner == "engine.trainer")  # as a finished run does


@pytest.mark.slow
def test_after_a_failing_evict_the_next_load_runs(tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))

    def broken() -> None:
        raise RuntimeError("driver says no")

    engine.register_resident("host.broken", broken)
    host = HostModel(engine)
    with pytest.raises(EngineError) as raised:
        engine.images.load(str(tiny_pipeline("sdxl")))
    assert raised.value.code == "evict_failed" and "host.broken" in raised.value.message
    assert engine.status()["job"] is None and engine.residency.owner is None
    assert engine.images.load(str(tiny_pipeline("sdxl")))["loaded"] and host.evicted == 1
    engine.images.unload()


def test_unregister_resident() -> None:
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"])
    host = HostModel(engine)
    assert engine.unregister_resident("host.chat-model") is True
    assert engine.unregister_resident("host.chat-model") is False
    assert engine.residency.acquire("engine.pipeline") == [] and host.evicted == 0
    for reserved in ("engine.pipeline", "engine.trainer"):
        with pytest.raises(EngineError):
            engine.unregister_resident(reserved)
        with pytest.raises(EngineError):
            engine.register_resident(reserved, lambda: None)


# -- 6. one GPU job at a time, generate included --------------------------------------------


@pytest.mark.slow
def test_a_running_generate_holds_the_engine_and_generates_queue(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    engine.images.load(str(tiny_pipeline("sdxl")))
    inside, release = threading.Event(), threading.Event()
    results: list[str] = []

    def hold(step: int, total: int) -> None:
        inside.set()
        assert release.wait(timeout=120)

    def generate(progress: Callable[[int, int], None] | None) -> None:
        [image] = engine.images.generate("a fox", steps=2, width=64, height=64, progress=progress)
        results.append(f"{image.size}")

    first = threading.Thread(target=generate, args=(hold,))
    first.start()
    assert inside.wait(timeout=120)
    second = threading.Thread(target=generate, args=(None,))
    second.start()
    config = {"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(write_dataset(tmp_path / "d", count=1)),
              "resolution": 64, "steps": 2, "device": "cpu"}
    with pytest.raises(Busy):
        engine.training.start(config)
    with pytest.raises(Busy):
        engine.images.load(str(tiny_pipeline("sdxl")))
    assert engine.status()["job"] == "generating" and results == []  # (unload would wait: test_batches)
    release.set()
    first.join(timeout=120)
    second.join(timeout=120)
    assert results == ["(64, 64)", "(64, 64)"]  # the second waited its turn, then ran
    assert engine.status()["job"] is None and engine.images.unload()


@pytest.mark.slow
def test_a_generate_while_training_is_busy(tmp_path: Path, tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    engine.training.start({"base_model": str(tiny_pipeline("sdxl")), "dataset_dir": str(write_dataset(tmp_path / "d", count=1)),
                           "resolution": 64, "steps": 100_000, "lora_rank": 2, "device": "cpu"})
    try:
        with pytest.raises(Busy):
            engine.images.generate("a fox", steps=1, width=64, height=64)
    finally:
        engine.training.stop(save=False)
        engine.training.wait(timeout=300)


# -- 2, over HTTP: --allow-hub keeps confinement, and hub ids reach the hub path ----------------


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> Iterator[tuple[str, Engine, Path]]:
    base = tmp_path_factory.mktemp("hub-server")
    models, outside = base / "models", base / "outside"
    (models / "org").mkdir(parents=True)
    outside.mkdir()
    linked_pipeline(tiny_pipeline("sdxl"), outside / "sdxl")
    (models / "org" / "escape").symlink_to(outside / "sdxl")  # inside a root, leading out
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    with LiveServer(create_app(engine, ServerSettings(model_roots=(models,), allow_hub=True))) as url:
        yield url, engine, models


def test_allow_hub_never_loads_a_symlink_out_as_a_hub_id(hub_server: tuple[str, Engine, Path]) -> None:
    url, engine, _ = hub_server
    host = HostModel(engine, "host.http-test")
    try:
        response = httpx.post(f"{url}/v1/images/load", json={"model": "org/escape"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "path_outside_roots"
        assert engine.status()["pipeline"] is None and host.evicted == 0
    finally:
        engine.unregister_resident("host.http-test")


def test_allow_hub_sends_a_real_hub_id_to_the_hub_and_refuses_it_offline(hub_server: tuple[str, Engine, Path]) -> None:
    url, engine, _ = hub_server
    response = httpx.post(f"{url}/v1/images/load", json={"model": "someone-offline/FLUX.1-dev-not-here"}, timeout=60)
    assert response.json()["error"]["code"] == "hub_offline", response.text
    empty = httpx.post(f"{url}/v1/images/load", json={"model": ""}, timeout=60)
    assert empty.status_code == 422 and empty.json()["error"]["code"] == "invalid_request"
    assert engine.status()["pipeline"] is None


def test_allow_hub_never_loads_a_folder_of_the_servers_working_directory(
    hub_server: tuple[str, Engine, Path], tmp_path: Path, tiny_pipeline: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, engine, _ = hub_server
    linked_pipeline(tiny_pipeline("sdxl"), tmp_path / "org" / "cwd-model")
    monkeypatch.chdir(tmp_path)  # "org/cwd-model" now exists relative to the server process
    response = httpx.post(f"{url}/v1/images/load", json={"model": "org/cwd-model"}, timeout=60)
    assert response.json()["error"]["code"] == "model_not_found", response.text
    assert engine.status()["pipeline"] is None


@pytest.mark.parametrize(
    ("name", "prequantised"),
    [
        ("someorg/checkpoint4-FLUX.1-dev", False),  # "int4" inside a word is no marker
        ("someorg/mint4-flux-dev", False),
        ("someorg/paint4k-FLUX.1-dev", False),
        ("someorg/FLUX.1-dev-bnb4bitx", False),
        ("someorg/FLUX.1-dev-int4", True),
        ("someorg/FLUX.1-dev_int4_v2", True),
        ("someorg/FLUX.1-dev-bnb-4bit", True),
        ("someorg/flux.1-dev.nf4", True),
    ],
)
def test_pre_quantised_markers_are_read_as_whole_tokens(name: str, prequantised: bool) -> None:
    flux = REGISTRY.family("flux")
    assert flux.is_prequantised(name) is prequantised
    # The same reading decides training: a dense repo named checkpoint4-... trains in bf16.
    error = training_precision_preflight_error(REGISTRY, flux, preset("h100"), "bf16", base_repo=name)
    assert (error is not None and error.code == "prequantised_base") is prequantised


def test_a_pre_quantised_repos_download_is_its_own_size_not_the_dense_repos(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FACTS: FLUX.1-dev is 23.8 + 9.8 + 0.2 GB in bf16; a bnb 4-bit repo holds the
    denoiser at ~0.30 of that, so it downloads about 23.8 * 0.30 + 10.0 = 17 GB."""
    from engine.cli import main

    assert main(["plan", "--model", "diffusers/FLUX.1-dev-bnb-4bit", "--hardware", "h100", "--json"]) == 0
    out = capsys.readouterr()
    weights = json.loads(out.out)["model"]["weights"]
    assert weights["here"] is False
    assert abs(weights["download_gb"] - (23.8 * 0.30 + 9.8 + 0.2)) < 1.0, weights
    assert "about 17 GB" in out.err
    # The dense repo stays its full size.
    assert main(["plan", "--model", "black-forest-labs/FLUX.1-dev", "--hardware", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["weights"]["download_gb"] == 33.8
