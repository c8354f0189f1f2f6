"""LoRAs in generate: every family, every way in (Python, CLI, HTTP), on real tiny pipelines.

The LoRAs are built the way a trainer leaves them: a peft adapter with
non-zero random B matrices on the family's default targets, saved with the
pipeline class's own ``save_lora_weights``. The reference for every image is
stock diffusers (``load_lora_weights`` on the same pipeline).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.cli import main
from engine.hardware import presets
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, LoraPlanInput, ModelFacts, plan_inference
from engine.preflight.lora import LoraChoice, LoraMismatch, parse_lora_arg, plan_input, read_loras
from engine.preflight.model import resolve_model
from engine.runtime.lora_check import converted_state_dict, unmatched_modules
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.service.facade import Engine
from engine.testing.checkpoints import write_gguf

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
FAMILIES = ["flux", "qwen_image", "zimage", "sdxl"]
SIZE = {"width": 64, "height": 64}


def make_lora(
    pipeline: Path, family: str, out: Path, *, seed: int = 0, rank: int = 4, targets: list[str] | None = None
) -> Path:
    """A LoRA for ``pipeline``'s denoiser with non-zero random weights, saved
    by the pipeline class's own ``save_lora_weights``; returns its file."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    spec = REGISTRY.family(family)
    pipe = diffusers.DiffusionPipeline.from_pretrained(pipeline)
    denoiser = getattr(pipe, spec.pipeline.denoiser)
    torch.manual_seed(seed)
    denoiser.add_adapter(LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=targets or list(spec.lora.targets),
    ))
    state = {k: v * 4 for k, v in get_peft_model_state_dict(denoiser).items()}  # a visible change
    type(pipe).save_lora_weights(str(out), **{f"{spec.pipeline.denoiser}_lora_layers": state})
    return out / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def loras(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``loras(family, seed)``: a LoRA file for the family's tiny pipeline (built once)."""
    built: dict[tuple[str, int], Path] = {}

    def get(family: str, seed: int = 0) -> Path:
        if (family, seed) not in built:
            folder = tmp_path_factory.mktemp(f"lora-{family}-{seed}")
            built[family, seed] = make_lora(tiny_pipeline(family), family, folder, seed=seed)
        return built[family, seed]

    return get


def session_for(model: Path, files=(), *, switching: bool = False, base: Path | None = None,
                request: InferenceRequest = InferenceRequest()) -> InferenceSession:
    source = resolve_model(REGISTRY, model, base=base)
    request = dataclasses.replace(request, loras=plan_input(files, switching=switching))
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request)
    session = InferenceSession(REGISTRY, source, plan, request, loras=files)
    session.load()
    return session


def image(session: InferenceSession, seed: int = 3, **kwargs: object) -> np.ndarray:
    [result] = session.generate(GenerateRequest("a lighthouse at dusk", steps=2, seed=seed, **SIZE, **kwargs))  # type: ignore[arg-type]
    return np.asarray(result).astype(np.float64) / 255.0


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, atol=1e-5, rtol=0))


# -- every family: changes the image, equals stock diffusers, scale 0 is no LoRA ---------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_changes_the_image_and_equals_stock_diffusers(
    family: str, tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path]
) -> None:
    folder, file = tiny_pipeline(family), loras(family)
    files = read_loras([LoraChoice(str(file.parent), 1.0)])  # a run folder works as the path
    fp32 = InferenceRequest(dtype="fp32")  # where a single LoRA is fused (bf16 keeps it beside the weights)
    unfused = session_for(folder, files, switching=True, request=fp32)
    fused = session_for(folder, files, request=fp32)
    stock = session_for(folder, request=fp32)
    try:
        assert unfused.plan.value("lora") == "unfused" and fused.plan.value("lora") == "fused"
        with_lora, fused_image = image(unfused), image(fused)
        plain = image(stock)
        stock.pipeline.load_lora_weights(str(file))
        stock_unfused = image(stock)
        stock.pipeline.fuse_lora(components=[REGISTRY.family(family).pipeline.denoiser])
        stock_fused = image(stock)
        unfused.set_loras([dataclasses.replace(files[0], scale=0.0)])
        at_zero = image(unfused)
        unfused.set_loras([])
        removed = image(unfused)
    finally:
        for session in (unfused, fused, stock):
            session.unload()
    assert np.abs(with_lora - plain).mean() > 1e-3, "the LoRA changes the image"
    assert same(with_lora, stock_unfused)
    assert same(fused_image, stock_fused)
    assert same(at_zero, plain) and same(removed, plain)


# -- the plan's lora control ---------------------------------------------------------------


def _facts(family: str) -> ModelFacts:
    spec = REGISTRY.family(family)
    return ModelFacts(spec, spec.default_checkpoint, REGISTRY.component_sizes(spec, spec.default_checkpoint))


@pytest.mark.parametrize(
    ("loras", "request_", "expected"),
    [
        (LoraPlanInput(), InferenceRequest(), "none"),
        (LoraPlanInput(count=1, max_rank=16, params=10**7), InferenceRequest(quant="none", compile="off", dtype="fp32"),
         "fused"),
        # bf16 weights: fused, a LoRA would round them for good
        (LoraPlanInput(count=1, max_rank=16, params=10**7), InferenceRequest(quant="none", compile="off"), "unfused"),
        (LoraPlanInput(count=1, max_rank=16, params=10**7), InferenceRequest(quant="int8", compile="off"), "unfused"),
        (LoraPlanInput(count=2, max_rank=16, params=10**7), InferenceRequest(quant="none", compile="off"), "unfused"),
        (LoraPlanInput(count=1, max_rank=16, params=10**7, switching=True), InferenceRequest(quant="none", compile="off"), "unfused"),
        (LoraPlanInput(count=2, max_rank=32, params=10**7), InferenceRequest(quant="none", compile="on"), "hotswap"),
    ],
)
def test_plan_decides_how_loras_are_applied(loras: LoraPlanInput, request_: InferenceRequest, expected: str) -> None:
    plan = plan_inference(REGISTRY, _facts("flux"), presets.preset("h100"), dataclasses.replace(request_, loras=loras))
    assert plan.value("lora") == expected
    assert plan["lora"].reason
    if expected == "hotswap":
        assert "rank-32" in plan["lora"].reason
    assert plan.to_dict()["resolved"]["lora"]["value"] == expected


def test_lora_memory_is_counted_in_the_plan() -> None:
    request = InferenceRequest(quant="none", compile="off")
    without = plan_inference(REGISTRY, _facts("sdxl"), presets.preset("h100"), request)
    big = LoraPlanInput(count=1, max_rank=128, params=500_000_000)  # 1 GB in bf16
    with_lora = plan_inference(REGISTRY, _facts("sdxl"), presets.preset("h100"), dataclasses.replace(request, loras=big))
    assert with_lora.estimate.resident_gb == pytest.approx(without.estimate.resident_gb + 1.0, abs=0.05)


def test_lora_argument_parsing() -> None:
    assert parse_lora_arg("a/b.safetensors") == LoraChoice("a/b.safetensors", 1.0)
    assert parse_lora_arg("a/b.safetensors:0.5") == LoraChoice("a/b.safetensors", 0.5)
    assert parse_lora_arg("C:/x/run:0.8") == LoraChoice("C:/x/run", 0.8)
    with pytest.raises(Exception, match="outside"):
        parse_lora_arg("b.safetensors:80")


# -- several LoRAs, switching without reloading ------------------------------------------------


@pytest.mark.slow
def test_two_loras_with_scales_and_switching_never_reloads_the_base(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, first, second = tiny_pipeline("zimage"), loras("zimage", 0), loras("zimage", 1)
    loads = []
    original = InferenceSession._load_pipeline

    def counted(self: InferenceSession, *args: object, **kwargs: object) -> object:
        loads.append(self.source.location)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InferenceSession, "_load_pipeline", counted)
    engine = Engine(hardware=HARDWARE)
    status = engine.images.load(str(folder), loras=[f"{first}:0.7", {"path": str(second), "scale": 0.5}])
    assert status["plan"]["resolved"]["lora"]["value"] == "unfused"  # two LoRAs keep separate scales
    try:
        both = _engine_image(engine)
        only_first = _engine_image(engine, loras=[f"{first}:0.7"])
        first_full = _engine_image(engine, loras=[str(first)])
        none = _engine_image(engine, loras=[])
        again = _engine_image(engine, loras=[f"{first}:0.7", f"{second}:0.5"])
        applied = engine.status()["pipeline"]["loras"]["applied"]
    finally:
        engine.images.unload()
    assert len(loads) == 1, "switching LoRAs or scales never reloads the base"
    assert [a["scale"] for a in applied] == [0.7, 0.5]
    assert same(both, again)
    for a, b in [(both, only_first), (only_first, first_full), (first_full, none)]:
        assert not same(a, b)
    stock = session_for(folder)
    try:
        stock.pipeline.load_lora_weights(str(first), adapter_name="a")
        stock.pipeline.load_lora_weights(str(second), adapter_name="b")
        stock.pipeline.set_adapters(["a", "b"], adapter_weights=[0.7, 0.5])
        assert same(image(stock), both)
    finally:
        stock.unload()


def _engine_image(engine: Engine, **options: object) -> np.ndarray:
    [result] = engine.images.generate("a lighthouse at dusk", steps=2, seed=3, **SIZE, **options)  # type: ignore[arg-type]
    return np.asarray(result).astype(np.float64) / 255.0


# -- refusals: before anything is evicted, never half-applied -------------------------------------


@pytest.mark.slow
def test_a_lora_for_another_family_is_refused_before_eviction(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    engine = Engine(hardware=HARDWARE)
    evicted: list[str] = []
    engine.register_resident("host-model", lambda: evicted.append("host-model"), size_gb=1.0)
    with pytest.raises(LoraMismatch) as refused:
        engine.images.load(str(tiny_pipeline("sdxl")), loras=[str(loras("flux"))])
    assert refused.value.code == "lora_mismatch"
    assert "FLUX.1" in refused.value.message and "match nothing" in refused.value.message
    assert evicted == [] and engine.status()["pipeline"] is None
    assert "host-model" in [r.name for r in engine.residency.residents()]

    code = main([
        "generate", "--model", str(tiny_pipeline("sdxl")), "--lora", str(loras("flux")),
        "--prompt", "x", "-o", str(tmp_path / "x.png"), "--steps", "2", "--width", "64", "--height", "64",
    ])
    assert code == 2 and not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_a_lora_with_some_foreign_keys_is_refused_not_half_applied(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(loras("zimage"))
    key = next(k for k in state if k.endswith("lora_A.weight") and ".layers.0." in k)
    state[key.replace("layers.0.", "layers.99.")] = state[key].clone()
    state[key.replace("layers.0.", "layers.99.").replace("lora_A", "lora_B")] = state[key.replace("lora_A", "lora_B")].clone()
    save_file(state, str(tmp_path / "mixed.safetensors"))
    session = session_for(tiny_pipeline("zimage"), switching=True)
    try:
        with pytest.raises(LoraMismatch, match="1 of"):
            session.set_loras(read_loras([LoraChoice(str(tmp_path / "mixed.safetensors"))]))
        assert session.loras is not None and session.loras.applied == ()
        assert not any("lora" in name for name, _ in session.denoiser.named_modules())
    finally:
        session.unload()


@pytest.mark.slow
def test_asked_for_partially_the_matching_modules_load_and_the_plan_counts_both(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    """``partial``: the module the model lacks is skipped (the image is the clean LoRA's, pixel for
    pixel), the plan names it; refused without, pointing at --lora-partial; the CLI takes it too."""
    from safetensors.torch import load_file, save_file

    clean = loras("zimage")
    state = load_file(clean)
    key = next(k for k in state if k.endswith("lora_A.weight") and ".layers.0." in k)
    foreign = key.replace("layers.0.", "layers.99.")
    state[foreign] = state[key].clone()
    state[foreign.replace("lora_A", "lora_B")] = state[key.replace("lora_A", "lora_B")].clone()
    mixed = tmp_path / "mixed.safetensors"
    save_file(state, str(mixed))
    base, asked = tiny_pipeline("zimage"), {"steps": 2, "width": 64, "height": 64, "seed": 4}
    with Engine(hardware=HARDWARE) as engine:
        with pytest.raises(LoraMismatch, match="--lora-partial"):
            engine.images.load(str(base), loras=[str(mixed)])
        status = engine.images.load(str(base), loras=[{"path": str(mixed), "partial": True}])
        counted = status["plan"]["lora_modules"]  # type: ignore[index]
        partial = np.asarray(engine.images.generate("a fox", **asked)[0])
        engine.images.load(str(base), loras=[str(clean)])
        whole = np.asarray(engine.images.generate("a fox", **asked)[0])
    module = foreign.removesuffix(".lora_A.weight").removeprefix("diffusion_model.")
    assert counted["unmatched"] == 1 and counted["matched"] > 0 and module.split(".", 1)[-1] in counted["skipped"][0]
    assert np.array_equal(partial, whole)
    code = main(["generate", "--model", str(base), "--lora", str(mixed), "--lora-partial", "--prompt", "x",
                 "-o", str(tmp_path / "x.png"), "--steps", "1", "--width", "64", "--height", "64"])
    assert code == 0 and (tmp_path / "x.png").is_file()


@pytest.mark.slow
def test_a_norms_full_rank_difference_is_named_never_dropped_unsaid(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    """A trainer's ``<norm>.diff`` (a full-rank difference diffusers' loader drops with a log line):
    refused naming it; asked for partially, the rest loads (the clean LoRA's image) and the plan
    names it skipped. An all-zero one changes nothing and passes."""
    from safetensors.torch import load_file, save_file

    clean = loras("zimage")
    state = load_file(clean)
    key = next(k for k in state if k.endswith("lora_A.weight") and ".layers.0." in k)
    prefix = key[: key.index("layers.0.")]
    norm = f"{prefix}layers.0.attention_norm1.diff"
    held, zero = tmp_path / "norm_diff.safetensors", tmp_path / "zero_diff.safetensors"
    save_file({**state, norm: torch.randn(64)}, str(held))
    save_file({**state, norm: torch.zeros(64)}, str(zero))
    base, asked = tiny_pipeline("zimage"), {"steps": 2, "width": 64, "height": 64, "seed": 4}
    with Engine(hardware=HARDWARE) as engine:
        with pytest.raises(LoraMismatch, match="attention_norm1 \\(full-rank difference\\)"):
            engine.images.load(str(base), loras=[str(held)])
        status = engine.images.load(str(base), loras=[{"path": str(held), "partial": True}])
        skipped = status["plan"]["lora_modules"]["skipped"]  # type: ignore[index]
        partial = np.asarray(engine.images.generate("a fox", **asked)[0])
        engine.images.load(str(base), loras=[str(zero)])
        zeroed = np.asarray(engine.images.generate("a fox", **asked)[0])
        engine.images.load(str(base), loras=[str(clean)])
        whole = np.asarray(engine.images.generate("a fox", **asked)[0])
    assert skipped == [f"{prefix}layers.0.attention_norm1 (full-rank difference)"]
    assert np.array_equal(partial, whole) and np.array_equal(zeroed, whole)


# -- kohya format in, through the CLI; PNG metadata; no overwrite ----------------------------------


def _kohya_sdxl_lora(folder: Path, out: Path) -> tuple[Path, int]:
    """A kohya sd-scripts style SDXL LoRA written from known module names:
    UNet attention projections and the first text encoder's attention projections."""
    import diffusers
    from safetensors.torch import save_file

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    torch.manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    modules = [
        ("lora_unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", pipe.unet),
        ("lora_unet", "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", pipe.unet),
        ("lora_unet", "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0", pipe.unet),
        ("lora_unet", "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_v", pipe.unet),
    ] + [
        ("lora_te1", f"text_model.encoder.layers.{i}.self_attn.{proj}", pipe.text_encoder)
        for i in (0, 1) for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
    ]
    for prefix, name, model in modules:
        linear = model.get_submodule(name if hasattr(model, "text_model") or prefix == "lora_unet" else name.removeprefix("text_model."))
        key = f"{prefix}_{name.replace('.', '_')}"
        state[f"{key}.lora_down.weight"] = torch.randn(4, linear.in_features) * 0.5
        state[f"{key}.lora_up.weight"] = torch.randn(linear.out_features, 4) * 0.5
        state[f"{key}.alpha"] = torch.tensor(2.0)
    path = out / "kohya_sdxl.safetensors"
    save_file(state, str(path))
    return path, len(modules)


@pytest.mark.slow
def test_kohya_sdxl_lora_applies_through_generate_with_png_metadata(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import diffusers

    folder = tiny_pipeline("sdxl")
    file, modules = _kohya_sdxl_lora(folder, tmp_path)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    converted = converted_state_dict(type(pipe), read_loras([LoraChoice(str(file))])[0], unet_config=pipe.unet.config)
    unmatched, total = unmatched_modules(converted, {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)})
    assert (unmatched, total) == ([], modules)

    out = tmp_path / "out.png"
    args = ["generate", "--model", str(folder), "--prompt", "a fox", "-o", str(out), "--steps", "2",
            "--width", "64", "--height", "64", "--seed", "11", "--json"]
    assert main([*args, "--lora", f"{file}:0.8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seed"] == 11
    assert report["status"]["loras"]["applied"][0]["scale"] == 0.8
    with Image.open(out) as written:
        meta = json.loads(written.text["diffusion-engine"])
        with_lora = np.asarray(written.convert("RGB"))
    assert meta["prompt"] == "a fox" and meta["seed"] == 11 and meta["steps"] == 2
    assert (meta["width"], meta["height"]) == (64, 64) and meta["model"] == str(folder)
    assert meta["loras"] == [{"path": str(file.resolve()), "scale": 0.8}]

    assert main(args) == 2, "an existing output is never overwritten without --overwrite"
    capsys.readouterr()
    assert main([*args, "--overwrite"]) == 0
    with Image.open(out) as written:
        assert json.loads(written.text["diffusion-engine"])["loras"] == []
        assert not np.array_equal(np.asarray(written.convert("RGB")), with_lora)


@pytest.mark.slow
def test_generate_prints_the_random_seed_it_used(tiny_pipeline: Callable[[str], Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "seeded.png"
    assert main(["generate", "--model", str(tiny_pipeline("zimage")), "--prompt", "a fox", "-o", str(out),
                 "--steps", "2", "--width", "64", "--height", "64"]) == 0
    printed = capsys.readouterr().out
    with Image.open(out) as written:
        seed = json.loads(written.text["diffusion-engine"])["seed"]
    assert f"seed {seed}" in printed


# -- quantised bases: unfused adapters beside int8 and GGUF weights ---------------------------------


@pytest.mark.slow
def test_int8_base_with_a_lora_generates_unfused(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path]
) -> None:
    folder = tiny_pipeline("flux")
    files = read_loras([LoraChoice(str(loras("flux")))])
    plain = session_for(folder, request=InferenceRequest(quant="int8"))
    session = session_for(folder, files, request=InferenceRequest(quant="int8"))
    try:
        assert session.plan.value("transformer_quant") == "int8" and session.quantised_layers > 0
        assert session.plan.value("lora") == "unfused"
        with_lora, without = image(session), image(plain)
        assert session.status()["loras"]["fused"] is False
    finally:
        session.unload()
        plain.unload()
    assert np.isfinite(with_lora).all() and np.abs(with_lora - without).mean() > 1e-3


@pytest.mark.slow
def test_gguf_base_with_a_lora_generates_unfused(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    base = tiny_pipeline("flux")
    gguf = write_gguf(base, "transformer", tmp_path / "tiny-flux-Q8_0.gguf")
    files = read_loras([LoraChoice(str(loras("flux")))])
    plain = session_for(gguf, base=base)
    session = session_for(gguf, files, base=base)
    try:
        assert session.source.kind == "gguf" and session.plan.value("lora") == "unfused"
        assert any(isinstance(p, GGUFParameter) for p in session.denoiser.parameters())
        with_lora, without = image(session), image(plain)
    finally:
        session.unload()
        plain.unload()
    assert np.isfinite(with_lora).all() and np.abs(with_lora - without).mean() > 1e-3



def test_a_gguf_with_a_lora_and_no_base_is_refused_base_required_as_typed(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    """``generate --model X.gguf --lora FILE`` with no ``--base``: the same ``base_required``
    as without the LoRA (LoRAs run on diffusers only, so no sd.cpp path could take it), never
    diffusers' OSError from looking for the default base's model_index.json."""
    from tests.support import run_cli

    gguf = write_gguf(tiny_pipeline("flux"), "transformer", tmp_path / "tiny-flux-Q8_0.gguf")
    result = run_cli("generate", "--model", str(gguf), "--lora", str(loras("flux")), "--prompt", "a cat",
                     "--out", str(tmp_path / "cat.png"), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "error[base_required]" in result.stderr and "--base DIR" in result.stderr
    assert not (tmp_path / "cat.png").exists()

# -- HTTP: load and generate bodies, the OpenAI endpoint, paths confined to the LoRA roots ----------


@pytest.mark.slow
def test_http_loras_on_load_generate_and_openai(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    import httpx

    from engine.server.app import ServerSettings, create_app
    from tests.support import LiveServer

    folder, file = tiny_pipeline("zimage"), loras("zimage")
    engine = Engine(hardware=HARDWARE)
    settings = ServerSettings(model_roots=(folder.parent,), lora_roots=(file.parent,))
    relative = file.name
    body = {"prompt": "a lighthouse at dusk", "steps": 2, "seed": 3, **SIZE}
    with LiveServer(create_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=120) as client:
        loaded = client.post("/v1/images/load", json={"model": folder.name, "loras": [{"path": relative, "scale": 0.9}]})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["loras"]["applied"][0]["scale"] == 0.9
        with_lora = client.post("/v1/images/generate", json=body).json()["images"][0]
        none = client.post("/v1/images/generate", json={**body, "loras": []}).json()["images"][0]
        assert with_lora != none
        again = client.post("/v1/images/generate", json={**body, "loras": [{"path": relative, "scale": 0.9}]})
        assert again.json()["images"][0] == with_lora
        openai = client.post("/v1/images/generations", json={
            "prompt": "a fox", "size": "64x64", "loras": [{"path": relative, "scale": 0.5}],
        })
        assert openai.status_code == 200 and _decoded(openai.json()["data"][0]["b64_json"]).size == (64, 64)
        assert engine.status()["pipeline"]["loras"]["applied"][0]["scale"] == 0.5
        outside = client.post("/v1/images/generate", json={**body, "loras": [{"path": str(tmp_path / "x.safetensors")}]})
        assert outside.status_code >= 400 and outside.json()["error"]["code"] == "path_outside_roots"
        missing = client.post("/v1/images/generate", json={**body, "loras": [{"path": "nope.safetensors"}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"
    engine.images.unload()


def _decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


# -- compile: adapters hot-swapped into declared slots, no recompile on a switch ----------------------


@pytest.mark.slow
def test_with_compile_a_lora_switch_hot_swaps_without_recompiling(
    tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path]
) -> None:
    folder = tiny_pipeline("zimage")
    first, second = (read_loras([LoraChoice(str(loras("zimage", seed)))])[0] for seed in (0, 1))
    graphs: list[int] = []

    def counting_backend(graph: torch.fx.GraphModule, _inputs: object) -> Callable[..., object]:
        graphs.append(1)  # called once per graph dynamo compiles
        return graph.forward

    source = resolve_model(REGISTRY, folder)
    request = InferenceRequest(compile="on", loras=plan_input([first], switching=True))
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request)
    session = InferenceSession(REGISTRY, source, plan, request, loras=[first], compile_backend=counting_backend)  # type: ignore[arg-type]
    session.load()
    try:
        assert plan.value("compile") == "regional" and plan.value("lora") == "hotswap"
        with_first = image(session)
        compiled = len(graphs)
        session.set_loras([dataclasses.replace(second, scale=0.6)])
        with_second = image(session)
        assert compiled > 0 and len(graphs) == compiled, "a hot swap reuses the compiled graphs"
        assert session.status()["loras"]["applied"][0]["scale"] == 0.6
    finally:
        session.unload()
    stock = session_for(folder)
    try:
        stock.pipeline.load_lora_weights(str(second.path))
        stock.pipeline.set_adapters(["default_0"], adapter_weights=[0.6])
        assert same(image(stock), with_second)
    finally:
        stock.unload()
    assert not same(with_first, with_second)


# -- ai-toolkit / ComfyUI spelling: ``diffusion_model.`` keys, converted by diffusers ------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen_image", "zimage"])
def test_diffusion_model_prefixed_lora_gives_the_diffusers_image(
    family: str, tiny_pipeline: Callable[[str], Path], loras: Callable[..., Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    file = loras(family)
    renamed = {"diffusion_model." + k.removeprefix("transformer."): v for k, v in load_file(file).items()}
    save_file(renamed, str(tmp_path / "ai_toolkit.safetensors"))
    other = read_loras([LoraChoice(str(tmp_path / "ai_toolkit.safetensors"))])
    diffusers_format = read_loras([LoraChoice(str(file))])
    session = session_for(tiny_pipeline(family), other, switching=True)
    try:
        converted = image(session)
        session.set_loras(diffusers_format)
        reference = image(session)
    finally:
        session.unload()
    assert same(converted, reference)
