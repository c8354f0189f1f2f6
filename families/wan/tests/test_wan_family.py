"""The wan plugin: the contract (its video run included), its table's specifics, both experts."""

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.plugins import Registry
from engine.policy.video import InvalidVideoShape, frames_for_seconds, video_shape
from engine.testing import FamilyContract


class TestWanContract(FamilyContract):
    family_name = "wan"


def test_each_variant_has_its_clip_rules(engine_registry: Registry) -> None:
    wan = engine_registry.family("wan")
    ti2v = wan.checkpoint("Wan-AI/Wan2.2-TI2V-5B-Diffusers")
    a14b = wan.checkpoint("wan2.2-t2v-a14b")
    small = wan.checkpoint("/models/Wan2.1-T2V-1.3B-Diffusers")
    assert (wan.video_of(ti2v).fps, wan.video_of(ti2v).default_frames, wan.video_of(ti2v).size_multiple) == (24, 121, 32)
    assert wan.geometry_of(ti2v).token_pixels == 32 and wan.geometry_of(small).token_pixels == 16
    assert (wan.video_of(small).fps, wan.video_of(small).presets[0]) == (16, (832, 480))
    assert a14b.expert_guidance == 3.0 and "transformer_2" in wan.denoisers
    assert dict(wan.workflows_of(ti2v)) == {"txt2img": "WanPipeline", "img2vid": "WanImageToVideoPipeline"}


def test_the_shape_gate_names_the_nearest_counts_and_the_presets(engine_registry: Registry) -> None:
    wan = engine_registry.family("wan")
    small = wan.checkpoint("wan2.1-t2v-1.3b")
    with pytest.raises(InvalidVideoShape, match="frames=80: .*4k\\+1.*the nearest valid counts are 77 and 81") as off:
        video_shape(wan, small, frames=80)
    assert off.value.status == 422
    with pytest.raises(InvalidVideoShape, match="multiples of 16.*832x480, 480x832"):
        video_shape(wan, small, width=840, height=480)
    with pytest.raises(InvalidVideoShape, match="beyond what Wan 2.1 T2V-1.3B was trained at"):
        video_shape(wan, small, width=1280, height=720)
    shape = video_shape(wan, small)
    assert (shape.frames, shape.width, shape.height, shape.fps, shape.latent_frames) == (81, 832, 480, 16, 21)
    assert shape.tokens == 21 * (832 // 16) * (480 // 16)


def test_seconds_become_frames_on_the_lattice(engine_registry: Registry) -> None:
    wan = engine_registry.family("wan")
    assert frames_for_seconds(wan, wan.checkpoint("wan2.1-t2v-1.3b"), 5).frames == 81  # 5 s at 16 fps
    snapped = frames_for_seconds(wan, wan.checkpoint("wan2.2-ti2v-5b"), 4.1)  # 4.1 s x 24 + 1 = 99.4
    assert snapped.frames == 97 and snapped.snapped and "snapped to 97" in snapped.note()
    assert frames_for_seconds(wan, wan.checkpoint("wan2.2-ti2v-5b"), 12).frames == 121  # capped at the range


@pytest.mark.slow
def test_two_experts_render_and_each_denoises(tmp_path: Path, engine_registry: Registry) -> None:
    """The A14B shape: both experts run (the second below the boundary), and int8 quantises both."""
    from engine.hardware.probe import probe
    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine
    from families.wan.tiny import build_tiny_two_experts

    folder = build_tiny_two_experts(tmp_path / "Wan2.2-T2V-A14B-tiny")
    engine = Engine(registry=engine_registry, hardware=probe(verify=False))
    engine.images.load(str(folder), request=InferenceRequest(quant="int8", width=64, height=64))
    pipe = engine.images.session.pipeline
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    clip = engine.videos.generate("a red fox", frames=5, width=64, height=64, steps=4, seed=1)
    assert len(clip.frames) == 5 and clip.recipe["checkpoint"] == "wan2.2-t2v-a14b"
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls
    cached = [getattr(getattr(pipe, name), "is_cache_enabled", False) for name in calls]
    assert cached in ([True, True], [False, False]), f"the step cache reached one expert only: {cached}"
    assert cached[0] == (engine.images.loaded_plan().value("step_cache") == "fbcache")  # type: ignore[union-attr]
    assert engine.status()["pipeline"]["quantised_layers"] >= 2 * 4  # type: ignore[index]
    from torchao.utils import TorchAOBaseTensor

    for name in calls:
        weight = getattr(pipe, name).blocks[0].attn1.to_q.weight
        assert isinstance(weight, TorchAOBaseTensor), f"{name} was not quantised"
    engine.images.unload()


@pytest.mark.slow
def test_wan_renders_in_bf16_on_the_cpu(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """bf16 is the CPU plan's default where the CPU multiplies it natively (asked for here, so that the
    test holds on any CPU: ``tests/policy/test_cpu_kernel.py`` covers the choice); Wan keeps its time
    embedder and norms in fp32 beside bf16 blocks, and the latents were cast to the first (fp32) weight,
    so the first step failed (``Input type (float) and bias type (BFloat16)``) with a traceback."""
    import json

    from engine.cli import main
    from engine.runtime.video_files import read_mp4

    out = tmp_path / "clip.mp4"
    status = main(["generate", "--model", str(tiny_pipeline("wan")), "--prompt", "a fox", "--frames", "5",
                   "--width", "64", "--height", "64", "--steps", "2", "--dtype", "bf16", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    recipe = json.loads(out.with_suffix(".json").read_text())
    assert (recipe["engaged"]["dtype"], recipe["engaged"]["vae_dtype"]) == ("bf16", "fp32")
    frames, _ = read_mp4(out)
    assert len(frames) == 5 and len(set(frames[0].getdata())) > 1  # a picture, not a flat frame


def test_a_model_keeping_parts_in_fp32_takes_its_inputs_in_its_compute_dtype() -> None:
    """The glue between components of different dtypes reads the dtype a diffusers model computes
    in (passing over its keep-in-fp32 parts), not its first weight's."""
    import torch
    from diffusers import WanTransformer3DModel

    from engine.runtime.mixed_precision import _dtype_of

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                  in_channels=4, out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16,
                                  num_layers=1, rope_max_seq_len=32)
    model.to(torch.bfloat16)
    model.scale_shift_table.data = model.scale_shift_table.data.float()  # as from_pretrained keeps it
    assert next(model.parameters()).dtype == torch.float32  # the first weight is a kept-fp32 one
    assert _dtype_of(model) == torch.bfloat16
    assert _dtype_of(torch.nn.Sequential(torch.nn.Linear(1, 1).float(), torch.nn.Linear(8, 8).half())) == torch.float16


# -- the safeguards in the table, each with a test that fails when its entry goes ------------------


def test_the_wan_vae_decodes_in_fp32_whatever_the_compute_dtype() -> None:
    """``precision.keep_fp32``: bf16 decodes give banding and black frames."""
    from tests.support import table_plan

    for hardware in ("rtx4090", "h100", "a100-40g"):
        plan = table_plan("wan", hardware, "wan2.2-ti2v-5b")
        assert plan.value("vae_dtype") == "fp32", (hardware, plan["vae_dtype"].reason)
        assert "banding" in plan["vae_dtype"].reason


def test_wan_refuses_fp16_compute_naming_why() -> None:
    """``precision.fp16_unsafe``: Wan's DiT is bf16-native; fp16 activations overflow."""
    import pytest

    from engine.errors import PreflightError
    from tests.support import table_plan

    with pytest.raises(PreflightError) as refused:
        table_plan("wan", "rtx4090", "wan2.2-ti2v-5b", dtype="fp16")
    assert refused.value.code == "fp16_unsafe" and "overflow" in refused.value.message


@pytest.mark.slow
def test_a_two_expert_folder_is_a14b_whatever_its_name(tmp_path: "Path") -> None:
    """A local two-expert folder not named like the A14B repo is A14B by its files (its
    transformer_2 and 16-channel VAE), as the trainer reads it: 1280x720 on its multiple of 16
    and seconds at its 16 fps, where TI2V-5B (the name's fallback) refused 1280x720."""
    from pathlib import Path

    from engine.contract.plugins import load_registry
    from engine.policy.video import frames_for_seconds, video_shape
    from engine.preflight.model import resolve_model
    from families.wan.tiny import build_tiny_pipeline, build_tiny_two_experts

    registry = load_registry()
    folder = build_tiny_two_experts(Path(str(tmp_path)) / "wan-mine")
    source = resolve_model(registry, str(folder))
    assert source.checkpoint is not None and source.checkpoint.name == "wan2.2-t2v-a14b"
    shape = video_shape(source.family, source.checkpoint, frames=81, width=1280, height=720)
    assert (shape.width, shape.height) == (1280, 720)
    assert frames_for_seconds(source.family, source.checkpoint, 5.0).fps == 16
    single = resolve_model(registry, str(build_tiny_pipeline(Path(str(tmp_path)) / "wan-other")))
    assert single.checkpoint is not None and single.checkpoint.name == "wan2.2-ti2v-5b"  # one expert, 48 channels


def test_wan_1_3b_plans_fp32_on_a_t4_where_its_denoiser_fits() -> None:
    """No bf16 on a T4 and Wan refuses fp16: fp32, decided by the denoiser and VAE (5.7 GB of
    fp32 DiT), not by the 22.8 GB fp32 UMT5 that runs once per prompt, which stays on the host
    (it streamed the whole pipeline block by block every step). TI2V-5B's fp32 denoiser (about
    20 GB) still does not fit the card, and is still refused."""
    import pytest

    from engine.errors import PreflightError
    from tests.support import table_plan

    small = table_plan("wan", "t4", "wan2.1-t2v-1.3b")
    assert small.value("dtype") == "fp32" and "no native bf16" in small["dtype"].reason
    # The encoder is placed on its own: on the host, run on the CPU per prompt; the denoiser resident.
    assert (small.value("text_encoder_memory"), small.value("memory_mode")) == ("host", "resident")
    assert "22.8 GB" in small["text_encoder_memory"].reason and "5.7 GB" in small["text_encoder_memory"].reason
    assert small.estimate.resident_gb < small.estimate.budget_gb  # counted without the encoder
    with pytest.raises(PreflightError) as refused:
        table_plan("wan", "t4", "wan2.2-ti2v-5b")
    assert refused.value.code == "no_safe_dtype"


def test_the_a14b_offload_reason_carries_its_numbers() -> None:
    """Why A14B streams on a 24 GB card, in numbers: both experts' 57.2 GB of weights, with the
    overhead, against the card's budget (it said only "66.9 GB with overhead does not fit")."""
    from tests.support import table_plan

    plan = table_plan("wan", "rtx4090", "wan2.2-t2v-a14b")
    reason = plan["memory_mode"].reason
    assert plan.value("memory_mode") == "group_offload"
    assert "57.2 GB of weights" in reason and "66.9 GB with overhead" in reason and "GB budget" in reason


def test_a14b_samples_by_its_publishers_recipe() -> None:
    """40 steps, guidance 4.0 and 3.0 for the low-noise expert (the model card's), documented as a
    departure from the earlier system's 50 / 5.0 in docs/architecture.md."""
    from pathlib import Path

    from engine.contract.plugins import load_registry

    a14b = load_registry().family("wan").checkpoint("wan2.2-t2v-a14b")
    assert a14b is not None and (a14b.default_steps, a14b.default_guidance, a14b.expert_guidance) == (40, 4.0, 3.0)
    notes = (Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "Wan 2.2 T2V-A14B samples 40 steps at guidance 4.0" in notes and "50 / 5.0" in notes


@pytest.mark.slow
def test_the_prompts_keys_and_values_are_computed_once_per_call_and_the_clip_is_unchanged(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    """The exact text K/V cache is on by default: from the second step the text embedder and each
    block's cross-attention keys and values come from memory (both CFG prompts); the clip equals
    the one with the cache's modules run every step (stock ``WanPipeline``, bit for bit)."""
    import numpy as np
    import torch
    from diffusers import WanPipeline

    from engine.service.facade import Engine

    folder = tiny_pipeline("wan")
    with Engine() as engine:
        engine.images.load(str(folder))
        clip = engine.videos.generate("a square", frames=5, steps=3, width=64, height=64, seed=2, guidance=4.0)
        cache = engine.status()["pipeline"]["text_kv_cache"]  # type: ignore[index]
    assert cache["sites"] > 0 and cache["misses"] == 2 * cache["sites"]  # each module, once per prompt (cond, uncond)
    assert cache["hits"] == 2 * 2 * cache["sites"]  # steps 2 and 3, both prompts
    from engine.testing.stock import planned_dtypes

    plain = WanPipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder))(
        "a square", num_frames=5, num_inference_steps=3, width=64, height=64, guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(2), output_type="pil").frames[0]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(clip.frames, plain, strict=True))
