"""The training-memory tool drives any installed family with a memory probe, a plugin's too.

``python -m engine.testing.memory_figures`` is the supported tool (the
bench script runs it); here it runs the worked example's family, which is not
built in: its narrow real-tensor step is counted the same with real and fake
tensors, and a family without a probe is told what to add.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.plugins import load_registry
from engine.testing import memory_figures


@pytest.mark.slow
def test_the_tool_measures_a_plugin_family_alike_on_real_and_fake_tensors(
    install_example: Callable[[], Path],
) -> None:
    install_example()
    d = memory_figures.Denoiser.of(load_registry().family("sd3"))
    real, extra = memory_figures.measure_step(d, d.narrow, 128, 32, False, dtype=memory_figures.torch.float32,
                                              fake=False, profile=True)
    fake, fextra = memory_figures.measure_step(d, d.narrow, 128, 32, False, dtype=memory_figures.torch.float32)
    assert real.activations_peak > 0 and fake.activations_peak == real.activations_peak
    # The counter agrees with the CPU allocator's own accounting within a few percent.
    assert extra["tracker_peak"] == pytest.approx(extra["profiler_peak"], rel=0.05)
    assert fextra["tracker_peak"] == extra["tracker_peak"]


def test_a_family_without_a_probe_is_told_what_to_add(capsys: pytest.CaptureFixture[str]) -> None:
    flux = load_registry().family("flux")
    bare = dataclasses.replace(flux, training=dataclasses.replace(flux.training, probe=None))
    with pytest.raises(memory_figures.NoProbe, match=r"probe=MemoryProbe\("):
        memory_figures.Denoiser.of(bare)
    with pytest.raises(SystemExit, match="unknown family 'nosuch'"):
        memory_figures.main(["--families", "nosuch"])


def test_every_built_in_family_carries_its_probe() -> None:
    registry = load_registry()
    for name in ("flux", "qwen_image", "sdxl", "zimage"):
        probe = registry.family(name).training.probe
        assert probe is not None and probe.derive and probe.blocks, name
