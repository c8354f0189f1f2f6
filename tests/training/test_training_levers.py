"""Training levers (LR / warmup defaults, flow shift, loss weighting, EMA,
optimizer), each resolved with its reason, and caption embeddings cached on
disk across runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.errors import PreflightError
from engine.hardware.presets import preset
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.runtime.prompt_cache import PromptCache
from engine.testing.datasets import write_dataset
from engine.training import levers
from engine.requests.training import TrainingConfig
from engine.training.preflight import TrainingPlan, preflight_training
from engine.training.trainer import run_training

REGISTRY = load_registry()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("levers-data"), count=2, size=64)


def make_plan(base: Path, data: Path, **overrides: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": 2,
        "lora_rank": 4, "device": "cpu", **overrides,
    })
    return preflight_training(REGISTRY, config, probe(verify=False))


def test_the_dry_run_plan_shows_every_lever_with_its_reason(tiny_pipeline: Callable[[str], Path], dataset: Path) -> None:
    resolved = make_plan(tiny_pipeline("flux"), dataset, steps=200).to_dict()["resolved"]
    for lever in ("learning_rate", "warmup_steps", "lr_scheduler", "flow_shift", "loss_weighting", "ema", "optimizer"):
        assert resolved[lever]["reason"], lever  # type: ignore[index]
    assert resolved["learning_rate"]["value"] == 1e-4 and resolved["learning_rate"]["source"] == "auto"  # type: ignore[index]
    assert resolved["warmup_steps"]["value"] == 10 and "FLUX.1" in resolved["warmup_steps"]["reason"]  # type: ignore[index]
    assert resolved["lr_scheduler"]["value"] == "constant_with_warmup"  # type: ignore[index]
    assert resolved["flow_shift"]["value"] == 1.0  # type: ignore[index]
    short = make_plan(tiny_pipeline("flux"), dataset, steps=30).to_dict()["resolved"]["warmup_steps"]
    assert short["value"] == 3 and "capped at a tenth" in short["reason"]  # type: ignore[index]
    asked = make_plan(tiny_pipeline("flux"), dataset, learning_rate=3e-4, warmup_steps=0, flow_shift=2.5).to_dict()["resolved"]
    assert (asked["learning_rate"]["value"], asked["warmup_steps"]["value"], asked["flow_shift"]["value"]) == (3e-4, 0, 2.5)  # type: ignore[index]
    assert asked["lr_scheduler"]["value"] == "constant"  # type: ignore[index]


def test_qwen_image_shifts_by_resolution_and_epsilon_families_have_no_shift() -> None:
    qwen = REGISTRY.family("qwen_image")
    objective = REGISTRY.training_objective(qwen)
    assert objective is not None
    shifts = [levers.resolve_flow_shift(qwen, objective, None, side).value for side in (512, 1024, 1328)]
    assert shifts[0] < shifts[1] < shifts[2] and shifts[1] == pytest.approx(math.exp(0.5 + 0.4 * (4096 - 256) / 7936), rel=1e-3)
    sdxl = REGISTRY.family("sdxl")
    epsilon = REGISTRY.training_objective(sdxl)
    assert epsilon is not None and levers.resolve_flow_shift(sdxl, epsilon, None, 1024).value is None
    with pytest.raises(PreflightError, match="flow_shift"):
        levers.resolve_flow_shift(sdxl, epsilon, 3.0, 1024)


def test_adamw8bit_is_accepted_by_the_config_and_refused_on_cpu(tiny_pipeline: Callable[[str], Path], dataset: Path) -> None:
    with pytest.raises(PreflightError, match="CUDA") as refused:
        make_plan(tiny_pipeline("flux"), dataset, optimizer="adamw8bit")
    assert refused.value.code == "optimizer_unavailable"
    config = TrainingConfig.from_data({"base_model": "x", "dataset_dir": str(dataset), "optimizer": "adamw8bit"})
    flux = REGISTRY.family("flux")
    objective = REGISTRY.training_objective(flux)
    on_gpu = levers.resolve_levers(flux, objective, config, "cuda", preset("rtx3090"))  # type: ignore[arg-type]
    assert on_gpu.optimizer.value == "adamw8bit" and "8-bit" in on_gpu.optimizer.reason


def test_flow_shift_moves_samples_toward_noise_and_min_snr_weighs_low_noise_down() -> None:
    sigmas = torch.linspace(0.05, 0.95, 19)
    assert levers.shift_sigmas(sigmas, 3.0).mean() > sigmas.mean()
    assert torch.equal(levers.shift_sigmas(sigmas, 1.0), sigmas)
    snr = levers.loss_weights("min_snr", sigmas, "flow_matching")
    assert snr[0] < snr[-1] and snr.max() <= 1
    bell = levers.loss_weights("bell", sigmas, "flow_matching")
    assert bell[9] == bell.max() and bell[0] < bell[9]
    eps = levers.loss_weights("min_snr", torch.tensor([0.1, 0.9]), "epsilon", snr=torch.tensor([100.0, 0.5]))
    assert eps.tolist() == pytest.approx([levers.MIN_SNR_GAMMA / 100, 1.0])


def test_adafactor_is_built_with_a_fixed_lr() -> None:
    from transformers.optimization import Adafactor

    param = torch.nn.Parameter(torch.zeros(4, 4))
    optimizer = levers.build_optimizer("adafactor", [param], 1e-3)
    assert isinstance(optimizer, Adafactor)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["relative_step"], group["scale_parameter"]) == (1e-3, False, False)


def test_adamw_is_torchs_fused_kernel_where_the_device_has_it_and_steps_like_the_loop() -> None:
    """The default per-parameter loop was about 8% of a CPU step; the fused kernel halves it
    and moves the weights as the loop does (to float rounding)."""
    torch.manual_seed(0)
    start = [torch.randn(8, 16) for _ in range(3)]
    grads = [torch.randn(8, 16) for _ in range(3)]
    moved = []
    for build in (lambda ps: levers.build_optimizer("adamw", ps, 1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = build(params)
        for _ in range(3):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
        moved.append((optimizer.param_groups[0].get("fused"), [p.detach() for p in params]))
    (fused, ours), (default, loop) = moved
    assert fused is True and not default
    assert all(torch.allclose(a, b, atol=1e-6) and not torch.equal(a, s) for a, b, s in zip(ours, loop, start))
    assert levers.adamw_kernel([torch.zeros(2, dtype=torch.int64)]) == {}  # not a float: torch's default


def test_the_prompt_cache_is_bounded_and_safe_to_delete(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        calls.append(prompts)
        return {"embeds": torch.ones(len(prompts), 4, 8)}

    cache = PromptCache(tmp_path / "cache", max_bytes=600)
    assert not cache.get_or_encode("enc", ["a"], {}, encode)[1]
    assert cache.get_or_encode("enc", ["a"], {}, encode)[1]  # reused
    assert not cache.get_or_encode("enc", ["a "], {}, encode)[1]  # the exact text is the key
    assert not cache.get_or_encode("other", ["a"], {}, encode)[1]  # so is the encoder
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) < 4  # trimmed to the bound
    for entry in (tmp_path / "cache").iterdir():
        entry.unlink()
    values, reused = cache.get_or_encode("enc", ["a"], {}, encode)
    assert not reused and torch.equal(values["embeds"], torch.ones(1, 4, 8)) and len(calls) == 4


def test_a_second_run_on_the_same_data_does_not_encode_captions_and_ema_is_a_second_adapter(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import families.flux.runtime as runtime

    calls: list[int] = []
    encode = runtime.encode_prompts

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return encode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime, "encode_prompts", counting)
    options = {"prompt_cache_dir": str(tmp_path / "cache"), "learning_rate": 1e-3, "ema_decay": 0.5, "steps": 1,
               "warmup_steps": 0,
               "optimizer": "adafactor", "loss_weighting": "min_snr", "flow_shift": 3.0}
    first = run_training(make_plan(tiny_pipeline("flux"), dataset, **options), tmp_path / "one",
                         lambda _: None, lambda: None, registry=REGISTRY)
    assert len(calls) == 1
    second = run_training(make_plan(tiny_pipeline("flux"), dataset, **options), tmp_path / "two",
                          lambda _: None, lambda: None, registry=REGISTRY)
    assert len(calls) == 1  # the captions came from disk
    assert first["type"] == second["type"] == "completed"
    outputs = first["outputs"]
    lora, ema = load_file(outputs["lora"]), load_file(outputs["lora_ema"])  # type: ignore[index]
    assert lora.keys() == ema.keys()
    assert any(not torch.equal(lora[k], ema[k]) for k in lora)  # the EMA lags the trained weights


def test_a_prompt_cache_entry_of_the_wrong_shape_is_encoded_again(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path
) -> None:
    """An entry that does not hold one row per prompt (replaced, or from an older writer)
    is re-encoded and rewritten instead of crashing the run at its first batch."""
    from safetensors.torch import save_file

    options = {"prompt_cache_dir": str(tmp_path / "cache"), "steps": 1}
    first = run_training(make_plan(tiny_pipeline("flux"), dataset, **options), tmp_path / "one",
                         lambda _: None, lambda: None, registry=REGISTRY)
    [entry] = (tmp_path / "cache").glob("*.safetensors")
    good = load_file(str(entry))
    assert all(v.shape[0] > 1 for v in good.values())
    save_file({k: v[:1].contiguous() for k, v in good.items()}, str(entry))  # one row for two prompts
    second = run_training(make_plan(tiny_pipeline("flux"), dataset, **options), tmp_path / "two",
                          lambda _: None, lambda: None, registry=REGISTRY)
    assert first["type"] == second["type"] == "completed"
    rewritten = load_file(str(entry))
    assert all(torch.equal(rewritten[k], good[k]) for k in good)


def test_batched_noise_gives_each_example_what_its_own_generator_draws(
    tiny_pipeline: Callable[[str], Path], dataset: Path,
) -> None:
    """The noise is drawn into one batch tensor, yet each row (and its timestep) is what the
    example's own generator gives alone: a batch split over ranks, or resumed, draws the same."""
    from engine.training.replicas import example_generators
    from engine.training.trainer import _noise

    plan = make_plan(tiny_pipeline("flux"), dataset)
    x0 = torch.randn(3, 16, 8, 8)
    noisy, sigmas, target = _noise(plan, x0, None, example_generators(7, 5, [0, 1, 2]))
    for slot in range(3):
        alone = _noise(plan, x0[slot:slot + 1], None, example_generators(7, 5, [slot]))
        assert torch.equal(alone[0][0], noisy[slot]) and torch.equal(alone[1][0], sigmas[slot])
        assert torch.equal(alone[2][0], target[slot])
    assert not torch.equal(target[0], target[1])  # each example its own draw
