"""Base-precision setup: what runs on CPU runs; GPU-only paths are exercised as far as CPU allows."""

from __future__ import annotations

import torch
from peft import LoraConfig

from engine.training.precision import (
    apply_base_precision,
    fp8_training_filter,
    int8_training_filter,
    pinned_sdpa,
    rms_norm_patch,
)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(512, 512)
        self.to_k = torch.nn.Linear(512, 512, bias=False)
        self.odd = torch.nn.Linear(512, 520)  # 520 % 16 == 8
        self.norm1 = torch.nn.Module()
        self.norm1.linear = torch.nn.Linear(512, 1024)  # modulation
        self.proj_out = torch.nn.Linear(512, 512)


def lora_block() -> torch.nn.Module:
    from peft import inject_adapter_in_model

    block = Block().requires_grad_(False)
    return inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_k"]), block)


def chosen(block: torch.nn.Module, keep) -> set[str]:  # type: ignore[no-untyped-def]
    return {name for name, module in block.named_modules() if keep(module, name)}


def test_fp8_filter_skips_lora_proj_out_and_unaligned_dims() -> None:
    assert chosen(lora_block(), fp8_training_filter(16)) == {"to_q.base_layer", "to_k.base_layer", "norm1.linear"}


def test_mxfp8_filter_also_skips_biased_linears() -> None:
    assert chosen(lora_block(), fp8_training_filter(32, allow_bias=False)) == {"to_k.base_layer"}


def test_int8_filter_skips_lora_and_modulation() -> None:
    assert chosen(lora_block(), int8_training_filter) == {"to_q.base_layer", "to_k.base_layer", "odd", "proj_out"}


def test_int8_base_is_quantised_after_the_adapter_and_still_backpropagates() -> None:
    block = lora_block()
    assert apply_base_precision(block, "int8") == 4
    assert type(block.to_q.base_layer.weight).__name__ != "Parameter"
    out = block.to_q(torch.randn(2, 512))
    out.sum().backward()
    grads = [p.grad for n, p in block.named_parameters() if "lora_" in n and "to_q" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_fp8_conversion_swaps_exactly_the_filtered_linears() -> None:
    """The float8 GEMMs need sm89+; the module swap itself runs anywhere."""
    block = lora_block()
    assert apply_base_precision(block, "fp8") == 3
    assert type(block.to_q.base_layer).__name__ == "Float8Linear"


def test_pinned_sdpa_is_a_no_op_off_cuda() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pinned_sdpa("cpu"):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert out.shape == q.shape


def test_rms_norm_patch_matches_and_is_removed_after() -> None:
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(64, eps=1e-6)
    x = torch.randn(3, 64)
    reference = norm(x)
    original = RMSNorm.forward
    with rms_norm_patch() as patched:
        assert patched is hasattr(torch.nn.functional, "rms_norm")
        assert torch.allclose(norm(x), reference, atol=1e-5)
    assert RMSNorm.forward is original
