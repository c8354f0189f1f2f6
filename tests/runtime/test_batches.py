"""Batches with a seed per image, out-of-memory halving, cancel and unload during a generate."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.runtime.batching import batch_items, chunk_size
from engine.service.facade import Cancelled, Engine

REGISTRY = load_registry()
SIZE = {"width": 64, "height": 64}


def test_batch_items_pair_prompts_and_seeds_and_chunks_fit_the_plan() -> None:
    assert [(i.prompt, i.seed) for i in batch_items("p", seed=4, count=3)] == [("p", 4), ("p", 5), ("p", 6)]
    assert [(i.prompt, i.seed) for i in batch_items("p", prompts=["a", "b"], seeds=[9])] == [("a", 9), ("b", 9)]
    assert [i.seed for i in batch_items("p", seeds=[3, 1, 2])] == [3, 1, 2]
    with pytest.raises(EngineError, match="one seed per prompt"):
        batch_items("p", prompts=["a", "b"], seeds=[1, 2, 3])
    assert chunk_size(8, "cpu", free_gb=100, per_image_gb=1) == 1  # CPU kernels are not batch-invariant
    assert chunk_size(8, "cuda", free_gb=2.5, per_image_gb=1) == 3  # one planned + two more in the headroom
    assert chunk_size(8, "cuda", free_gb=0, per_image_gb=1, requested=4) == 4


@pytest.fixture(scope="module")
def engine(tiny_pipeline: Callable[[str], Path]) -> Iterator[Engine]:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(tiny_pipeline("sdxl")))
    yield engine
    engine.images.unload()


def pixels(images: list[Any]) -> list[np.ndarray]:
    return [np.asarray(image) for image in images]


@pytest.mark.slow
def test_image_k_of_a_seed_list_is_the_single_image_of_seed_k(engine: Engine) -> None:
    batch = pixels(engine.images.generate("a red barn", seeds=[11, 5, 7], steps=1, **SIZE))
    alone = pixels(engine.images.generate("a red barn", seed=5, steps=1, **SIZE))[0]
    counted = pixels(engine.images.generate("a red barn", seed=10, count=2, steps=1, **SIZE))  # seeds 10, 11
    listed = pixels(engine.images.generate("unused", prompts=["a red barn", "a blue boat"], seeds=[7], steps=1, **SIZE))
    assert len(batch) == 3 and np.array_equal(batch[1], alone)
    assert np.array_equal(counted[1], batch[0]) and not np.array_equal(batch[0], batch[2])
    assert np.array_equal(listed[0], batch[2]) and not np.array_equal(listed[1], batch[2])


@pytest.mark.slow
def test_a_chunk_that_runs_out_of_memory_is_halved_and_recorded(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = pixels(engine.images.generate("a mill", seeds=[1, 2, 3, 4], batch=2, steps=1, **SIZE))
    pipeline_cls = type(engine.images.session.pipeline)  # noqa: SLF001 - the test plays the GPU running out
    real_call = pipeline_cls.__call__
    sizes: list[int] = []

    @functools.wraps(real_call)
    def small_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        chunk = len(kwargs["prompt"] if "prompt" in kwargs else kwargs["prompt_embeds"])  # embeddings: cached
        sizes.append(chunk)
        if chunk > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(pipeline_cls, "__call__", small_memory)
    images = pixels(engine.images.generate("a mill", seeds=[1, 2, 3, 4], batch=4, steps=1, **SIZE))
    assert sizes == [4, 2, 2]
    assert all(np.array_equal(a, b) for a, b in zip(images, reference, strict=True))
    [event] = engine.status()["pipeline"]["batch_events"]  # type: ignore[index]
    assert event["event"] == "out_of_memory_split" and event["chunk"] == 4 and event["into"] == [2, 2]


def _start(engine: Engine, steps: int, seen: list[int], reached: threading.Event, outcome: dict[str, Any]) -> threading.Thread:
    def progress(done: int, _total: int) -> None:
        seen.append(done)
        if done >= 2:
            reached.set()

    def run() -> None:
        try:
            outcome["images"] = engine.images.generate("a long night", steps=steps, progress=progress, **SIZE)
        except Cancelled as exc:
            outcome["cancelled"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.slow
def test_cancel_generation_stops_at_the_next_step(engine: Engine) -> None:
    seen: list[int] = []
    reached, outcome = threading.Event(), {}  # type: ignore[var-annotated]
    thread = _start(engine, 200, seen, reached, outcome)
    assert reached.wait(120)
    cancelled_after = seen[-1]
    assert engine.images.cancel()
    thread.join(120)
    assert "cancelled" in outcome and outcome["cancelled"].code == "cancelled"
    assert seen[-1] <= cancelled_after + 1  # at most the step that was running when asked
    assert engine.status()["job"] is None and not engine.images.cancel()


@pytest.mark.slow
def test_unload_during_a_generate_waits_for_it_then_frees(engine: Engine) -> None:
    """Last in this file: it unloads the module's engine (its teardown then finds nothing loaded)."""
    seen: list[int] = []
    reached, outcome = threading.Event(), {}  # type: ignore[var-annotated]
    thread = _start(engine, 8, seen, reached, outcome)
    assert reached.wait(120)
    assert engine.images.unload()  # blocks until the generate has finished
    thread.join(120)
    assert len(outcome["images"]) == 1 and seen[-1] == 8
    assert engine.status()["pipeline"] is None and engine.residency.owner is None


@pytest.mark.slow
def test_cli_prompt_and_seed_lists_and_an_input_image(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    """The CLI's --prompt (repeated), --seeds and --image reach the engine: each file
    records its own prompt and seed and replays alone; img2img changes the image."""
    import json

    from PIL import Image

    from engine.cli import main

    common = ["generate", "--model", str(tiny_pipeline("sdxl")), "--steps", "1", "--width", "64", "--height", "64"]
    assert main([*common, "--prompt", "a red barn", "--prompt", "a blue boat", "--seeds", "3,4",
                 "-o", str(tmp_path / "list.png")]) == 0
    assert main([*common, "--prompt", "a blue boat", "--seed", "4", "-o", str(tmp_path / "alone.png")]) == 0
    second = Image.open(tmp_path / "list-1.png")
    record = json.loads(second.text["diffusion-engine"])
    assert (record["prompt"], record["seed"], record["batch_index"]) == ("a blue boat", 4, 1)
    assert np.array_equal(np.asarray(second), np.asarray(Image.open(tmp_path / "alone.png")))
    assert main([*common, "--prompt", "a blue boat", "--seed", "4", "--image", str(tmp_path / "list-0.png"),
                 "--strength", "0.9", "-o", str(tmp_path / "none.png")]) == 2  # 1 step x 0.9 runs no step
    assert main([*common[:3], "--steps", "2", *common[5:], "--prompt", "a blue boat", "--seed", "4",
                 "--image", str(tmp_path / "list-0.png"), "--strength", "0.9", "-o", str(tmp_path / "img2img.png")]) == 0
    img2img = np.asarray(Image.open(tmp_path / "img2img.png"))
    assert img2img.shape == (64, 64, 3) and not np.array_equal(img2img, np.asarray(second))
    assert main([*common, "--prompt", "x", "--mask", str(tmp_path / "list-0.png"),
                 "-o", str(tmp_path / "bad.png")]) == 2  # a mask needs --image: refused before loading
