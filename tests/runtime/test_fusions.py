"""Eager fusions in the DiT blocks (modulation and gated residuals as ``torch.addcmul``):
equal to stock, reversible, idempotent, off on the ``off`` tier and with the kill
switch, and a block whose source changed left as diffusers wrote it.

On the tiny real pipelines of FLUX.1, Qwen-Image and Z-Image (the families whose
tables name fusion sites), in fp32 on the CPU.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.contract.family_sections import FusionSite
from engine.contract.plugins import load_registry
from engine.policy.plan import InferenceRequest
from engine.runtime.cpu_kernels import OnednnForward
from engine.runtime.fusions import fuse, fused_method, unfuse
from tests.support import pixels, session_for

REGISTRY = load_registry()
FUSED_FAMILIES = ("flux", "qwen_image", "zimage")


@pytest.mark.slow
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fused_blocks_generate_the_stock_image_and_unfuse_back_to_it(
    family: str, tiny_pipeline: Callable[[str], Path]
) -> None:
    """Every site the table names is fused at load on the default tier; the image equals
    stock up to float rounding; unfusing puts diffusers' own methods back (bit-identical)."""
    session = session_for(tiny_pipeline(family), InferenceRequest(speed="default", compile="off", dtype="fp32"))
    session.load()
    try:
        assert session.plan.value("eager_fusions") is True
        report = session.status()["eager_fusions"]
        sites = REGISTRY.family(family).speed.eager_fusions
        assert report["skipped"] == {}  # type: ignore[index]
        assert set(report["fused"]) <= {site.block for site in sites} and report["fused"]  # type: ignore[index]
        fused = pixels(session).astype(np.int16)
        assert unfuse(session.denoiser) == sum(report["fused"].values())  # type: ignore[index]
        # diffusers' own methods are back; the forwards left are the plan's oneDNN GEMM
        # routing of fp32 Linears (engine/runtime/cpu_kernels.py), which is not a fusion
        assert not any("forward" in m.__dict__ and not isinstance(m.__dict__["forward"], OnednnForward)
                       for m in session.denoiser.modules())
        stock = pixels(session).astype(np.int16)
        # Idempotent: fusing twice patches once, and the result is the fused image again.
        first = fuse(session.denoiser, sites)
        assert fuse(session.denoiser, sites).fused == {}
        assert first.fused == report["fused"]  # type: ignore[index]
        again = pixels(session).astype(np.int16)
    finally:
        session.unload()
    assert np.abs(fused - stock).max() <= 1  # one rounding instead of two: within a level of 255
    assert np.array_equal(fused, again)


@pytest.mark.slow
def test_the_fused_block_computes_what_the_stock_block_computes(tiny_pipeline: Callable[[str], Path]) -> None:
    """One FLUX double block, fused vs stock, on the same inputs: equal within fp32 rounding."""
    session = session_for(tiny_pipeline("flux"), InferenceRequest(speed="off"))
    session.load()
    try:
        block = session.denoiser.transformer_blocks[0]
        dim = block.norm1.linear.in_features
        torch.manual_seed(0)
        hidden, context, temb = torch.randn(1, 16, dim), torch.randn(1, 8, dim), torch.randn(1, dim)
        with torch.no_grad():
            stock = block(hidden, context, temb)
            forward, count, _ = fused_method(type(block), "forward")
            assert count == 6 and forward is not None
            fused = types.MethodType(forward, block)(hidden, context, temb)
    finally:
        session.unload()
    for want, got in zip(stock, fused, strict=True):
        assert torch.allclose(want, got, atol=1e-5, rtol=1e-5)


def test_off_tier_and_the_kill_switch_leave_the_blocks_as_diffusers_wrote_them() -> None:
    from engine.hardware.presets import preset
    from tests.support import table_plan

    assert table_plan("flux", "rtx4090", quant="none")["eager_fusions"].value is False  # off tier: bit-identical
    assert table_plan("flux", "rtx4090", speed="default")["eager_fusions"].value is True
    killed = table_plan("flux", "rtx4090", speed="default", env={"DIFFUSION_ENGINE_EAGER_FUSIONS": "0"})["eager_fusions"]
    assert killed.value is False and "DIFFUSION_ENGINE_EAGER_FUSIONS=0" in killed.reason
    assert table_plan("sdxl", preset("h100"), speed="default")["eager_fusions"].value is False  # no site in its table


@pytest.mark.slow
def test_a_block_whose_source_changed_is_left_unpatched_with_the_reason(
    tiny_pipeline: Callable[[str], Path],
) -> None:
    """A table expecting another count of fusible expressions (as after a diffusers
    change to the block) leaves that class as it is and says so; the others still fuse."""
    session = session_for(tiny_pipeline("flux"), InferenceRequest(speed="off"))
    session.load()
    try:
        changed = (FusionSite("FluxTransformerBlock", 7), FusionSite("FluxSingleTransformerBlock", 1))
        report = fuse(session.denoiser, changed)
        assert "FluxTransformerBlock" not in report.fused and report.fused["FluxSingleTransformerBlock"] >= 1
        assert "6 fusible expressions where the family's table expects 7" in report.skipped["FluxTransformerBlock"]
        assert all("forward" not in block.__dict__ for block in session.denoiser.transformer_blocks)
    finally:
        session.unload()
