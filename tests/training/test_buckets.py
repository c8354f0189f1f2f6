"""What the trainer is fed: aspect buckets, caption options, and a stop on a non-finite loss.

The bucket and caption rules are pure and checked directly; one real tiny
run (in-process, CPU, 64 px) on a dataset of three aspect ratios checks the
pixel sizes the real VAE encodes and the prompts the real text encoders see.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.testing.datasets import write_dataset
from engine.training.buckets import MAX_ASPECT, bucket_size, epoch_batches, fit, plan_buckets
from engine.training.captions import CaptionOptions, choose, prompt_table, shuffled, with_trigger
from engine.training.checkpoints import latest_checkpoint
from engine.requests.training import InvalidConfig, TrainingConfig
from engine.training.preflight import TrainingPlan, preflight_training

REGISTRY = load_registry()
FAMILY = "zimage"
#: (width, height) of the drawn images: square, landscape 3:2, portrait 2:3, two of each.
SHAPES = ((64, 64), (96, 64), (64, 96))


def write_shapes(folder: Path) -> Path:
    """Two images of each shape, captioned with comma-separated tags."""
    write_dataset(folder, count=2 * len(SHAPES), shapes=SHAPES)
    for index, caption in enumerate(sorted(folder.glob("*.txt"))):
        caption.write_text(f"shape {index}, red, round, drawn", encoding="utf-8")
    return folder


def make_plan(base: Path, data: Path, **overrides: object) -> TrainingPlan:
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(data), "resolution": 64, "steps": 2,
        "lora_rank": 2, "learning_rate": 1e-3, "device": "cpu", **overrides,
    })
    return preflight_training(REGISTRY, config, probe(verify=False))


# -- pure rules ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(64, 64), (96, 64), (64, 96), (1920, 1080), (1000, 1333), (333, 777), (5000, 400)])
@pytest.mark.parametrize(("resolution", "multiple"), [(64, 16), (512, 8), (1024, 16)])
def test_a_bucket_keeps_the_area_the_multiple_and_crops_only_the_rounding(
    size: tuple[int, int], resolution: int, multiple: int
) -> None:
    width, height = bucket_size(*size, resolution, multiple)
    assert width % multiple == 0 and height % multiple == 0
    assert width * height <= resolution * resolution
    shape = fit(size, (width, height))
    assert shape.box[2] - shape.box[0] == width and shape.box[3] - shape.box[1] == height
    covered = shape.resized[0] >= width and shape.resized[1] >= height
    assert covered and abs(shape.resized[0] / shape.resized[1] - size[0] / size[1]) < 0.05 * size[0] / size[1]
    if max(size[0] / size[1], size[1] / size[0]) <= MAX_ASPECT:
        # One side is filled exactly; the other loses at most what rounding to the multiple moved.
        assert min(shape.cropped) <= 1 and max(shape.cropped) <= multiple * max(shape.resized) / min(width, height)
        assert abs(math.log(width / height) - math.log(size[0] / size[1])) < math.log(1 + 2 * multiple / min(width, height))


def test_buckets_group_by_shape_and_warn_about_enlarging_and_extreme_aspects() -> None:
    plan = plan_buckets([(64, 64), (96, 64), (64, 96), (66, 66), (20, 20), (900, 100)],
                        ["a", "b", "c", "d", "e", "f"], 64, 16, warned={"e"})
    assert {(b.width, b.height): b.images for b in plan.buckets} == {
        (48, 80): (2,), (64, 64): (0, 3, 4), (80, 48): (1,), (128, 32): (5,),
    }
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("f (900x100) is past the 4:1")
    assert "enlarged" in plan_buckets([(20, 20)], ["e"], 64, 16).warnings[0]
    table = plan.to_dict()
    assert table["buckets"][0] == {"width": 48, "height": 80, "frames": 1, "images": 1}  # type: ignore[index]


def test_epoch_batches_stay_in_one_bucket_cover_every_image_and_follow_the_seed() -> None:
    groups = [[0, 3, 4], [1], [2, 5, 6, 7]]

    def permuter(seed: int) -> Callable[[int], list[int]]:
        rng = random.Random(seed)
        return lambda n: rng.sample(range(n), n)

    batches = epoch_batches(groups, 2, permuter(1))
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(any(set(b) <= set(g) for g in groups) and 1 <= len(b) <= 2 for b in batches)
    assert batches == epoch_batches(groups, 2, permuter(1)) != epoch_batches(groups, 2, permuter(2))


def test_caption_options_trigger_shuffle_keep_and_dropout() -> None:
    assert with_trigger("a red circle", "ohwx") == "ohwx, a red circle"
    assert with_trigger("ohwx, a red circle", "ohwx") == "ohwx, a red circle" and with_trigger("", "ohwx") == "ohwx"
    rng = random.Random(0)
    shuffles = {shuffled("first, b, c, d, e", 1, rng) for _ in range(30)}
    assert len(shuffles) > 5 and all(s.startswith("first, ") and sorted(s.split(", ")) == ["b", "c", "d", "e", "first"]
                                     for s in shuffles)
    options = CaptionOptions(trigger_word="ohwx", dropout=0.3, shuffle_tags=True, keep_tags=1)
    prompts, per_image, empty = prompt_table(["a, b, c, d", "x"], options, seed=7)
    # b, c, d have 6 orders (fewer than 8 shuffles): each cached once; "x" has one.
    assert prompts[empty] == "" and len(per_image[0]) == 6 and len(per_image[1]) == 1  # type: ignore[index]
    assert len({prompts[i] for i in per_image[0]}) == 6
    assert all(prompts[i].startswith("ohwx, a, ") for i in per_image[0])
    assert prompt_table(["a, b, c, d", "x"], options, seed=7) == (prompts, per_image, empty)
    picks = [choose(options, 7, step, 0, 3) for step in range(1000)]
    assert picks == [choose(options, 7, step, 0, 3) for step in range(1000)]  # a pure draw: resume repeats it
    assert 0.25 < picks.count(None) / 1000 < 0.35 and {0, 1, 2} <= set(picks)
    assert prompt_table(["a, b"], CaptionOptions(), 0) == (["a, b"], [[0]], None)


def test_caption_option_fields_are_validated() -> None:
    base = {"base_model": "/m", "dataset_dir": "/d"}
    with pytest.raises(InvalidConfig, match="keep_tags applies only with shuffle_tags"):
        TrainingConfig.from_data({**base, "keep_tags": 2})
    with pytest.raises(InvalidConfig, match="caption_dropout"):
        TrainingConfig.from_data({**base, "caption_dropout": 1.0})
    with pytest.raises(InvalidConfig, match="trigger_word"):
        TrainingConfig.from_data({**base, "trigger_word": " ohwx"})


# -- real runs ------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_aspect_ratios_train_in_three_buckets_at_their_own_sizes(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diffusers

    from engine.training.trainer import run_training

    plan = make_plan(tiny_pipeline(FAMILY), write_shapes(tmp_path / "data"), batch_size=2,
                     trigger_word="ohwx", caption_dropout=0.5, shuffle_tags=True, keep_tags=2,
                     prompt_cache=False)  # every prompt through the real encoders, none from an earlier run
    table = plan.to_dict()["buckets"]
    assert [(b["width"], b["height"], b["images"]) for b in table["buckets"]] == [  # type: ignore[index]
        (48, 80, 2), (64, 64, 2), (80, 48, 2)]
    encoded: list[tuple[int, ...]] = []
    real_encode = diffusers.AutoencoderKL.encode

    def spy(self: object, x: torch.Tensor, *args: object, **kwargs: object) -> object:
        encoded.append(tuple(x.shape))
        return real_encode(self, x, *args, **kwargs)

    monkeypatch.setattr(diffusers.AutoencoderKL, "encode", spy)
    runtime = importlib.import_module(plan.family.runtime_module)
    prompted: list[list[str]] = []
    real_prompts = runtime.encode_prompts
    monkeypatch.setattr(runtime, "encode_prompts",
                        lambda pipe, prompts, *a: prompted.append(list(prompts)) or real_prompts(pipe, prompts, *a))
    events: list[dict[str, object]] = []
    result = run_training(plan, tmp_path / "run", events.append, lambda: None)
    assert result["type"] == "completed", result
    # Pixels [1, 3, H, W] in dataset order: each image at its bucket, none square-cropped.
    assert encoded == [(1, 3, 64, 64), (1, 3, 48, 80), (1, 3, 80, 48)] * 2
    [prompts] = prompted
    assert "" in prompts and all(p.startswith("ohwx, shape ") for p in prompts if p)
    assert len(prompts) == 1 + 6 * 2  # the empty prompt + each caption's 2 free tags in both orders
    assert {p.split(", ", 3)[1] for p in prompts if p} == {f"shape {i}" for i in range(6)}  # kept in place
    caching = next(e for e in events if e.get("phase") == "caching")
    assert caching["buckets"] == table and caching["dataset"] == plan.dataset.to_dict()
    losses = [e["loss"] for e in events if e["type"] == "progress"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.training.trainer import NonFiniteLoss, run_training

    plan = make_plan(tiny_pipeline(FAMILY), write_dataset(tmp_path / "data", count=1), steps=2, save_every=1)
    runtime = importlib.import_module(plan.family.runtime_module)
    real_predict = runtime.predict
    calls: list[int] = []

    def prediction_that_overflows_at_step_2(*args: object) -> torch.Tensor:
        calls.append(1)
        value = real_predict(*args)
        return value * float("nan") if len(calls) == 2 else value

    monkeypatch.setattr(runtime, "predict", prediction_that_overflows_at_step_2)
    events: list[dict[str, object]] = []
    with pytest.raises(NonFiniteLoss) as raised:
        run_training(plan, tmp_path / "run", events.append, lambda: None)
    assert raised.value.code == "non_finite_loss"
    kept = latest_checkpoint(tmp_path / "run")
    assert kept is not None and kept.name == "step-00000001"
    assert "at step 2" in raised.value.message and str(kept) in raised.value.message
    assert [e["step"] for e in events if e["type"] == "progress"] == [1]
    assert not (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
    lora = load_file(str(kept / "pytorch_lora_weights.safetensors"))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())
