"""ConvRot's rotation: a block-diagonal regular Hadamard over groups of input channels.

ConvRot (Huang et al., 2025) spreads the outlier channels of a Linear's input before int8
quantisation by rotating each group of ``g`` input channels with a normalised *regular*
Hadamard matrix ``H`` (Kronecker powers of a symmetric 4x4 seed, so ``g`` is a power of 4).
``H`` is symmetric and orthogonal, hence its own inverse: ``x W^T = (x H)(W H)^T``, so the
weight is stored rotated (``W H``, quantised per row) and the input is rotated as it arrives;
de-rotating a stored weight is the same grouped product again. ComfyUI's ``int8_tensorwise``
files with ``convrot`` in their markers are laid out this way.
"""

from __future__ import annotations

import functools

import torch

_SEED = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


@functools.lru_cache(maxsize=8)
def regular_hadamard(size: int) -> torch.Tensor:
    """The normalised regular Hadamard matrix of ``size`` (a power of 4), in fp32."""
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"a regular Hadamard matrix is 4, 16, 64, 256... wide, not {size}")
    seed = torch.tensor(_SEED, dtype=torch.float32)
    matrix = seed
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, seed)
    return matrix / size**0.5


def rotated(values: torch.Tensor, group: int) -> torch.Tensor:
    """``values`` with each group of ``group`` entries of its last dimension multiplied by the
    Hadamard matrix (rotating an input, rotating a weight's rows, or undoing either), in
    ``values``' dtype."""
    width = values.shape[-1]
    if width % group:
        raise ValueError(f"{width} channels do not split into ConvRot groups of {group}")
    hadamard = regular_hadamard(group).to(values.device, values.dtype)
    return (values.reshape(*values.shape[:-1], width // group, group) @ hadamard).reshape(values.shape)
