"""Which Linear layers a scheme quantises, and what they then weigh. Pure.

One rule, two users: the runtime's torchao ``filter_fn`` asks
:func:`quantises` per module, and the planner asks :func:`quantised_gb` per
tensor of a checkpoint's safetensors header, so the bytes a plan predicts are
the bytes the build makes (``bench/planner_accuracy.py`` measures both).

The filter keeps small and sensitive layers dense: every Linear under 512
features on either side (its GEMM is too small to gain, and scales would cost
more than they save), and for int8 also norms, modulation and the timestep /
guidance / pooled-text embeddings (run at M = batch, and their ranges int8
clips), plus what each family's table lists in ``int8_dense_modules``: its
own names for those embedders, and layers run at M = prompt tokens, which
CUDA's int8 matmul (at least 16 rows) fails on for short prompts. A context
embedder (M = text tokens, padded) is quantised. fp8 needs dims divisible by
16, mxfp8 and nvfp4 by 32 (their block size). bitsandbytes nf4 takes every
Linear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_FEATURES = 512
#: Name fragments int8 leaves dense in every family (norms, modulation, the
#: timestep / guidance / pooled embedders); families add theirs.
INT8_SKIP: tuple[str, ...] = ("norm", "mod", "adaln", "timestep", "guidance", "pooled")
#: The schemes those rules apply to (int8 activations: the layers whose range int8 clips stay dense).
INT8_LIKE = ("int8", "int8_convrot")


@dataclass(frozen=True)
class WeightLayout:
    """Storage of one quantised weight: bytes per element plus bytes per output row."""

    bytes_per_weight: float
    bytes_per_row: float
    dims_multiple: int
    min_features: int = MIN_FEATURES


LAYOUTS = {
    # int8 data + fp32 scale and int8 zero point per row (torchao Int8Tensor).
    "int8": WeightLayout(1.0, 5.0, 1),
    # int8 laid alike, its rows rotated in ConvRot groups (inputs a multiple of 16).
    "int8_convrot": WeightLayout(1.0, 5.0, 16),
    # e4m3 data + fp32 scale per row.
    "fp8": WeightLayout(1.0, 4.0, 16),
    # e4m3 data + one e8m0 scale per 32-element block.
    "mxfp8": WeightLayout(1.0 + 1 / 32, 0.0, 32),
    # e2m1 data + one e4m3 scale per 16-element block.
    "nvfp4": WeightLayout(0.5 + 1 / 16, 0.0, 32),
    # nf4 data + an fp32 absmax per 64-element block; every Linear.
    "nf4": WeightLayout(0.5 + 4 / 64, 0.0, 1, min_features=1),
}


def quantises(
    scheme: str,
    module_name: str,
    in_features: int,
    out_features: int,
    dense_modules: Sequence[str] = (),
) -> bool:
    """Whether ``scheme`` quantises the Linear called ``module_name``.

    :param dense_modules: the family's ``int8_dense_modules`` (int8 only).
    """
    layout = LAYOUTS[scheme]
    if min(in_features, out_features) < layout.min_features:
        return False
    if in_features % layout.dims_multiple or out_features % layout.dims_multiple:
        return False
    if scheme not in INT8_LIKE:
        return True
    name = module_name.lower()
    return not any(token.lower() in name for token in (*INT8_SKIP, *dense_modules))


def dense_gb(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> float:
    """GB of ``(name, shape)`` tensors held in bf16 (2 bytes each)."""
    return sum(2 * math.prod(shape) for _, shape in tensors) / 1e9


def quantised_gb(
    tensors: Iterable[tuple[str, tuple[int, ...]]], scheme: str, dense_modules: Sequence[str] = ()
) -> float:
    """GB of a denoiser whose tensors are ``(name, shape)``, held in ``scheme``.

    A 2-D ``*.weight`` is taken for a Linear ``[out, in]``; everything left
    dense is counted at 2 bytes (bf16).
    """
    layout = LAYOUTS[scheme]
    total = 0.0
    for name, shape in tensors:
        numel = math.prod(shape)
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and quantises(scheme, module, shape[1], shape[0], dense_modules):
            total += numel * layout.bytes_per_weight + shape[0] * layout.bytes_per_row
        else:
            total += numel * 2
    return total / 1e9
