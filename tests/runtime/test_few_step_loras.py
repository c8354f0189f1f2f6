"""Few-step LoRAs set their own sampling: a Lightning LoRA (told by its name from Qwen-Image's
table) or any LoRA whose metadata says how it samples sets the steps and guidance a request
leaves open, said in the plan; an explicit value wins; Wan 2.2's lightx2v pair lands on both
experts and samples both at its guidance."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def write_lora(denoiser: object, target: Path, metadata: dict[str, str] | None = None, seed: int = 0,
               limit: int = 8) -> Path:
    """A diffusers-layout LoRA (``transformer.<module>.lora_A/B``) on the first ``limit`` attention
    Linears of ``denoiser``, strong enough to move a tiny model's image."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    state = {}
    modules = [(name, m) for name, m in denoiser.named_modules()  # type: ignore[attr-defined]
               if isinstance(m, torch.nn.Linear) and name.endswith(TARGETS)][:limit]
    for name, module in modules:
        state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features) * 0.3
        state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4) * 0.3
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target), metadata=metadata)
    return target


@pytest.fixture(scope="module")
def qwen(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("qwen_image")


def _qwen_transformer(folder: Path) -> object:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(str(folder / "transformer"))


def test_a_lightning_lora_is_told_by_its_name_and_sets_four_steps_without_guidance_in_the_plan(
    engine_registry: Registry, qwen: Path, tmp_path: Path,
) -> None:
    from engine.service.facade import Engine

    lora = write_lora(_qwen_transformer(qwen), tmp_path / "Qwen-Image-Lightning-4steps-V1.0.safetensors")
    with Engine(registry=engine_registry) as engine:
        ticket = engine.images.check_load(str(qwen), loras=[f"{lora}:1.0"])
        plain = engine.images.check_load(str(qwen))
    plan = ticket.plan
    assert plan.default_steps == 4 and plan.lora_sampling is not None and plan.lora_sampling.guidance == 1.0
    assert "Qwen-Image-Lightning, 4 steps" in plan.lora_sampling.reason and plan.lora_sampling.shift == 3.0
    assert plain.plan.default_steps != 4 and plain.plan.lora_sampling is None


@pytest.mark.slow
def test_its_sampling_is_the_default_and_an_explicit_value_wins(
    engine_registry: Registry, qwen: Path, tmp_path: Path,
) -> None:
    """With the LoRA and nothing asked: its 4 steps at guidance 1 (the image of asking them);
    asked 2 steps, 2 steps. A LoRA whose metadata says 3 steps samples 3, whatever its name."""
    from engine.service.facade import Engine

    transformer = _qwen_transformer(qwen)
    named = write_lora(transformer, tmp_path / "Qwen-Image-Lightning-4steps-V1.0.safetensors")
    said = write_lora(transformer, tmp_path / "my_turbo.safetensors", seed=1,
                      metadata={"sampling": json.dumps({"steps": 3, "guidance": 1.0})})
    size = {"width": 64, "height": 64, "seed": 5}

    def image(lora: Path, **asked: float) -> np.ndarray:
        return np.asarray(engine.images.generate("a red fox", loras=[f"{lora}:1.0"], **size, **asked)[0])

    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(qwen))
        assert np.array_equal(image(named), image(named, steps=4, guidance=1.0))
        assert np.array_equal(image(named, steps=2), image(named, steps=2, guidance=1.0))
        assert not np.array_equal(image(named, steps=2), image(named))
        assert np.array_equal(image(said), image(said, steps=3, guidance=1.0))


def test_a_malformed_sampling_in_a_loras_metadata_is_refused(engine_registry: Registry, qwen: Path,
                                                             tmp_path: Path) -> None:
    from engine.errors import EngineError
    from engine.service.facade import Engine

    lora = write_lora(_qwen_transformer(qwen), tmp_path / "bad.safetensors",
                      metadata={"sampling": json.dumps({"steps": "four"})})
    with Engine(registry=engine_registry) as engine:
        with pytest.raises(EngineError) as refused:
            engine.images.check_load(str(qwen), loras=[f"{lora}:1.0"])
    assert refused.value.code == "invalid_lora" and "sampling" in refused.value.message


@pytest.mark.slow
def test_a_wan22_lightx2v_pair_lands_on_both_experts_and_samples_both_at_its_guidance(
    engine_registry: Registry, tmp_path: Path,
) -> None:
    """Two files, ``..._high_noise`` and ``..._low_noise``: each on its expert (the low-noise half by
    the family's table), 4 steps, guidance 1 on both experts (the second expert's 3.0 too: with
    guidance 1 the pipeline runs no CFG at all); an asked guidance wins."""
    from diffusers import WanTransformer3DModel

    from engine.service.facade import Engine
    from families.wan.tiny import build_tiny_two_experts

    folder = build_tiny_two_experts(tmp_path / "wan22")
    high = write_lora(WanTransformer3DModel.from_pretrained(str(folder / "transformer")),
                      tmp_path / "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors")
    low = write_lora(WanTransformer3DModel.from_pretrained(str(folder / "transformer_2")),
                     tmp_path / "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors", seed=1)
    clip = {"frames": 5, "width": 64, "height": 64, "seed": 0}

    def frames(**asked: float) -> bytes:
        video = engine.videos.generate("a square", loras=[f"{high}:1", f"{low}:1"], **clip, **asked)
        return b"".join(frame.tobytes() for frame in video.frames)

    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        lightning = frames()
        pipe = engine.images.session._pipe  # type: ignore[union-attr]
        assert len(pipe.transformer.peft_config) == 1 and len(pipe.transformer_2.peft_config) == 1
        assert lightning == frames(steps=4, guidance=1.0, guidance_2=1.0)
        assert lightning != frames(guidance=4.0)  # asked guidance wins (real CFG again)
        plan = engine.images.check_load(str(folder), loras=[f"{high}:1", f"{low}:1"]).plan
    assert plan.default_steps == 4 and "lightx2v 4-step" in plan.lora_sampling.reason
    assert plan.lora_sampling.shift == 5.0 and "timestep shift 5" in plan.lora_sampling.reason


def test_a_shift_holds_the_scheduler_for_the_call_and_is_put_back() -> None:
    """Qwen-Image's resolution-dependent schedule and Wan's ``flow_shift`` both take a constant
    shift inside the block (the sigmas of diffusers' own scheduler made with that shift), then the
    pipeline's own scheduler returns; a scheduler without a shift keeps its schedule."""
    import types

    import torch
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from engine.runtime.scheduler_shift import shifted

    dynamic = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9)
    wan = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0)
    for own in (dynamic, wan):
        pipe = types.SimpleNamespace(scheduler=own)
        with shifted(pipe, 3.0) as took:
            assert took and pipe.scheduler is not own
            if own is dynamic:
                pipe.scheduler.set_timesteps(4, mu=0.7)  # the resolution's mu is ignored: the shift holds
                constant = FlowMatchEulerDiscreteScheduler(shift=3.0)
                constant.set_timesteps(4)
                assert torch.allclose(pipe.scheduler.sigmas, constant.sigmas)
            else:
                assert pipe.scheduler.config.flow_shift == 3.0
        assert pipe.scheduler is own
    ddim = types.SimpleNamespace(scheduler=DDIMScheduler())
    with shifted(ddim, 3.0) as took:
        assert not took


@pytest.mark.slow
def test_a_lightning_loras_shift_changes_its_schedule_and_a_metadata_shift_does_the_same(
    engine_registry: Registry, qwen: Path, tmp_path: Path,
) -> None:
    """Same weights: named Lightning (shift 3 from the table) and metadata saying shift 3 render
    alike; metadata saying 4 steps at guidance 1 and no shift renders the checkpoint's schedule,
    another image. The loaded pipeline's scheduler is its own again after each call."""
    from engine.service.facade import Engine

    transformer = _qwen_transformer(qwen)
    named = write_lora(transformer, tmp_path / "Qwen-Image-Lightning-4steps-V1.0.safetensors")
    said = write_lora(transformer, tmp_path / "said.safetensors",
                      metadata={"sampling": json.dumps({"steps": 4, "guidance": 1.0, "shift": 3.0})})
    unshifted = write_lora(transformer, tmp_path / "unshifted.safetensors",
                           metadata={"sampling": json.dumps({"steps": 4, "guidance": 1.0})})
    size = {"width": 64, "height": 64, "seed": 5}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(qwen))
        own = engine.images.session.pipeline.scheduler  # type: ignore[union-attr]
        images = {lora.name: np.asarray(engine.images.generate("a red fox", loras=[f"{lora}:1.0"], **size)[0])
                  for lora in (named, said, unshifted)}
        assert engine.images.session.pipeline.scheduler is own  # type: ignore[union-attr]
    assert np.array_equal(images[named.name], images[said.name])
    assert not np.array_equal(images[named.name], images[unshifted.name])


@pytest.mark.slow
@pytest.mark.parametrize("base", ["int8", "gguf"])
def test_on_a_quantised_base_it_sets_its_sampling_too(
    engine_registry: Registry, qwen: Path, tmp_path: Path, base: str,
) -> None:
    """On an int8 base (torchao) and a GGUF file the LoRA sits beside the quantised layers, and its
    sampling is the default as on the dense model: the image of asking its steps and guidance."""
    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine
    from engine.testing.checkpoints import write_gguf

    named = write_lora(_qwen_transformer(qwen), tmp_path / "Qwen-Image-Lightning-4steps-V1.0.safetensors")
    size = {"width": 64, "height": 64, "seed": 5, "loras": [f"{named}:1.0"]}
    with Engine(registry=engine_registry) as engine:
        if base == "gguf":
            engine.images.load(str(write_gguf(qwen, "transformer", tmp_path / "qwen-image-Q8_0.gguf")), base=str(qwen))
        else:
            engine.images.load(str(qwen), request=InferenceRequest(quant="int8"))
        assert engine.images.loaded_plan().value("transformer_quant") == ("int8" if base == "int8" else None)  # type: ignore[union-attr]
        default = np.asarray(engine.images.generate("a red fox", **size)[0])
        asked = np.asarray(engine.images.generate("a red fox", steps=4, guidance=1.0, **size)[0])
        other = np.asarray(engine.images.generate("a red fox", steps=2, **size)[0])
    assert np.array_equal(default, asked) and not np.array_equal(default, other)
