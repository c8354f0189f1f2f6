"""Fitting more and training better, across loads and runs: prompt embeddings
reused by a second load (and by streamed encoders, which then stay unloaded),
pre-cast fp8 text encoders planned as stored, and a LoRA EMA that a resumed
run continues."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import PreflightError
from engine.hardware.presets import preset
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.encoders import precast_encoders
from engine.policy.inference import plan_inference
from engine.policy.plan import InferenceRequest
from engine.preflight.headers import tensor_storage
from engine.preflight.model import resolve_model
from engine.runtime.generation import GenerateRequest
from engine.runtime.session import InferenceSession
from engine.testing.datasets import write_dataset
from engine.training.checkpoints import checkpoint_dirs, load_checkpoint
from engine.requests.training import TrainingConfig
from engine.training.preflight import preflight_training
from engine.training.trainer import run_training

REGISTRY = load_registry()


def generate(folder: Path, **asked: object) -> tuple[np.ndarray, InferenceSession]:
    request = InferenceRequest(quant="none", **asked)  # type: ignore[arg-type]
    source = resolve_model(REGISTRY, folder)
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), probe(verify=False), request)
    session = InferenceSession(REGISTRY, source, plan, request)
    session.load()
    try:
        [image] = session.generate(GenerateRequest("a lighthouse at dusk", steps=1, seed=3, width=32, height=32))
    except BaseException:
        session.unload()
        raise
    return np.asarray(image).astype(np.int16), session


@pytest.fixture
def encoder_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every forward of a CLIP or T5 text encoder, by class (any load's)."""
    from transformers import CLIPTextModel, T5EncoderModel

    calls: list[str] = []
    for cls in (CLIPTextModel, T5EncoderModel):
        forward = cls.forward

        def counting(self: torch.nn.Module, *args: object, _forward: Callable = forward, **kwargs: object) -> object:
            calls.append(type(self).__name__)
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counting)
    yield calls


@pytest.mark.slow
def test_a_second_load_takes_prompt_embeddings_from_disk_and_streamed_encoders_stay_unloaded(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoder_calls: list[str],
) -> None:
    monkeypatch.setenv("DIFFUSION_ENGINE_PROMPT_CACHE", str(tmp_path / "cache"))
    folder = tiny_pipeline("flux")
    uncached, session = generate(folder, prompt_cache=False)
    try:
        assert encoder_calls and not (tmp_path / "cache").exists()  # off: encoded, nothing written
        encoder_calls.clear()
        session.request = dataclasses.replace(session.request, prompt_cache=True)
        [image] = session.generate(GenerateRequest("a lighthouse at dusk", steps=1, seed=3, width=32, height=32))
        first = np.asarray(image).astype(np.int16)
    finally:
        session.unload()
    assert sorted(set(encoder_calls)) == ["CLIPTextModel", "T5EncoderModel"]  # a miss encodes and writes
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    encoder_calls.clear()
    second, session = generate(folder)  # a separate load of the same pipeline
    session.unload()
    assert encoder_calls == []
    assert np.array_equal(first, uncached) and np.array_equal(second, uncached)
    streamed, session = generate(folder, text_encoder_memory="streamed")
    try:
        assert session.plan.value("text_encoder_memory") == "streamed"
        stream = session.status()["text_encoders"]["stream"]  # type: ignore[index]
        assert stream["loads"] == 0  # type: ignore[index]
        assert session.pipeline.text_encoder is None and session.pipeline.text_encoder_2 is None  # freed, not used
    finally:
        session.unload()
    assert encoder_calls == [] and np.array_equal(streamed, uncached)


@pytest.mark.parametrize("poison", ["wrong shape", "nan", "bad list", "garbage"])
def test_a_poisoned_prompt_cache_entry_is_encoded_again_not_a_crash(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    encoder_calls: list[str], poison: str,
) -> None:
    """A cache entry replaced by another writer (a shared cache folder): the generate encodes the
    prompts again, gives the same pixels, and rewrites the entry (it crashed, or drew from NaN)."""
    from safetensors.torch import load_file as read, save_file as write

    monkeypatch.setenv("DIFFUSION_ENGINE_PROMPT_CACHE", str(tmp_path / "cache"))
    folder = tiny_pipeline("flux")
    clean, session = generate(folder)
    session.unload()
    [entry] = (tmp_path / "cache").glob("*.safetensors")
    good = {k: v.clone() for k, v in read(entry).items()}  # not a view of the file we overwrite
    if poison == "wrong shape":
        bad = {k: torch.zeros(*v.shape[:-1], v.shape[-1] + 3) for k, v in good.items()}
    elif poison == "nan":
        bad = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in good.items()}
    elif poison == "bad list":
        bad = {**good, "prompt_embeds#x": torch.zeros(1)}
    if poison == "garbage":
        entry.write_bytes(b"not a safetensors file")
    else:
        write(bad, str(entry))
    encoder_calls.clear()
    again, session = generate(folder)
    session.unload()
    assert encoder_calls, "the poisoned entry was used instead of encoding again"
    assert np.array_equal(again, clean)
    rewritten = read(entry)
    assert rewritten.keys() == good.keys() and all(torch.equal(rewritten[k], good[k]) for k in good)


@pytest.fixture(scope="module")
def fp8_flux(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX pipeline with its T5 saved as people download T5-XXL fp8:
    every matrix in float8_e4m3fn, norms (and the shared embedding) kept dense."""
    folder = tmp_path_factory.mktemp("fp8-t5") / "flux"
    shutil.copytree(tiny_pipeline("flux"), folder)
    for file in (folder / "text_encoder_2").glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v.to(torch.float8_e4m3fn) if v.ndim == 2 and "shared" not in k and "embed" not in k else v
                   for k, v in tensors.items()}, file, metadata={"format": "pt"})
    return folder


def test_a_precast_fp8_encoder_is_recognised_from_its_header_and_planned_as_stored(fp8_flux: Path) -> None:
    storage = tensor_storage(sorted((fp8_flux / "text_encoder_2").glob("*.safetensors")))
    fp8 = [(count, size) for _, dtype, count, size in storage if dtype == "F8_E4M3"]
    assert fp8 and all(size == count for count, size in fp8)  # 1 byte a parameter, read from the header
    dense_clip = tensor_storage(sorted((fp8_flux / "text_encoder").glob("*.safetensors")))
    assert precast_encoders({"text_encoder": dense_clip}) is None
    source = resolve_model(REGISTRY, fp8_flux)
    precast = source.precast_encoders
    assert precast is not None and (precast.scheme, precast.encoders) == ("fp8", ("text_encoder_2",))
    assert precast.stored_gb * 1e9 == sum(size for *_, size in storage) + sum(size for *_, size in dense_clip)
    scaled = [*storage, ("encoder.block.0.layer.0.SelfAttention.q.scale_weight", "F32", 1, 4)]
    with pytest.raises(PreflightError, match="scaled float8_e4m3fn") as refused:
        precast_encoders({"text_encoder_2": scaled})
    assert refused.value.code == "unsupported_encoder_checkpoint"
    facts = source.facts(REGISTRY)

    h100 = plan_inference(REGISTRY, facts, preset("h100"))
    chosen = h100["text_encoder_quant"]
    assert chosen.value == "fp8" and "pre-cast checkpoint" in chosen.reason and "float8_e4m3fn" in chosen.reason
    assert "not quantised again" in chosen.reason
    assert h100.estimate.components.text_encoders_gb == pytest.approx(precast.stored_gb)  # as stored, not re-sized

    # Layerwise fp8 (held as stored, upcast per layer) needs a CUDA GPU with native bf16: an
    # Ampere card holds it as stored too; a T4 upcasts it, sized dense.
    assert plan_inference(REGISTRY, facts, preset("rtx3090")).value("text_encoder_quant") == "fp8"
    t4 = plan_inference(REGISTRY, facts, preset("t4"))
    upcast = t4["text_encoder_quant"]
    assert upcast.value != "fp8" and "native bf16" in upcast.reason and "upcast" in upcast.reason
    dense = plan_inference(REGISTRY, resolve_model(REGISTRY, fp8_flux).facts(REGISTRY), probe(verify=False),
                           InferenceRequest(dtype="fp32"))  # upcast to fp32: larger than the fp8 as stored
    assert dense["text_encoder_quant"].value == "none" and "upcast" in dense["text_encoder_quant"].reason
    assert dense.estimate.components.text_encoders_gb > precast.stored_gb


def test_a_resumed_run_continues_the_lora_ema(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", count=2, size=64)

    def train(folder: Path, **overrides: object) -> dict[str, object]:
        config = TrainingConfig.from_data({
            "base_model": str(tiny_pipeline("flux")), "dataset_dir": str(data), "resolution": 64, "steps": 2,
            "lora_rank": 4, "device": "cpu", "learning_rate": 1e-3, "warmup_steps": 0, "ema_decay": 0.5,
            "save_every": 1, "prompt_cache_dir": str(tmp_path / "cache"), **overrides,
        })
        plan = preflight_training(REGISTRY, config, probe(verify=False))
        return run_training(plan, folder, lambda _: None, lambda: None, registry=REGISTRY)

    whole = train(tmp_path / "whole")
    halfway = checkpoint_dirs(tmp_path / "whole")[0]
    saved = load_checkpoint(halfway)["ema"]
    assert saved["decay"] == 0.5 and saved["shadow"] and all(t.dtype == torch.float32 for t in saved["shadow"])
    resumed = train(tmp_path / "resumed", resume_from=str(halfway))
    assert whole["type"] == resumed["type"] == "completed"
    one, two = load_file(whole["outputs"]["lora_ema"]), load_file(resumed["outputs"]["lora_ema"])  # type: ignore[index]
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)  # the average went on, not restarted
    trained = load_file(whole["outputs"]["lora"])  # type: ignore[index]
    assert any(not torch.equal(trained[k], one[k]) for k in one)


def test_a_precast_encoder_is_held_as_stored_and_computes_what_the_upcast_one_does(fp8_flux: Path) -> None:
    """The runtime half of ``fp8`` as stored (planned on fp8 machines): the file's
    fp8 matrices go back into the upcast encoder, whose outputs do not change."""
    from transformers import T5EncoderModel

    from engine.runtime.text_encoders import hold_precast

    encoder = T5EncoderModel.from_pretrained(fp8_flux, subfolder="text_encoder_2", dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 42, 7, 1]])
    with torch.no_grad():
        upcast = encoder(tokens).last_hidden_state
    files = sorted((fp8_flux / "text_encoder_2").glob("*.safetensors"))
    stored = [name for name, dtype, *_ in tensor_storage(files) if dtype == "F8_E4M3"]
    linears = {n: m for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)}
    held = [m for n, m in linears.items() if not n.endswith(".wo")]  # T5 keeps wo in fp32: its forward casts to it
    assert hold_precast(encoder, files) == len(held) > 0 and len(stored) > len(held)
    assert {m.weight.dtype for m in held} == {torch.float8_e4m3fn}  # 1 byte a parameter, as in the file
    with torch.no_grad():
        held = encoder(tokens).last_hidden_state
    assert torch.equal(held, upcast)
