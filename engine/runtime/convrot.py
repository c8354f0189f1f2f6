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


#: The group ConvRot's own exports use; narrower layers take the widest power of 4 dividing them.
DEFAULT_GROUP = 256
_GROUPS = (256, 64, 16)
#: The attribute a rotated Linear carries: its group.
ROTATED = "_convrot_group"


def group_for(in_features: int) -> int:
    """The Hadamard group for a Linear of ``in_features`` inputs (0: none divides them)."""
    return next((group for group in _GROUPS if in_features % group == 0), 0)


def rotate_inputs(module: torch.nn.Module, group: int) -> None:
    """Rotate what ``module`` (a Linear whose weight is stored rotated) receives, as it runs."""

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (rotated(args[0], group), *args[1:])

    setattr(module, ROTATED, group)
    module.register_forward_pre_hook(hook)


def rotate_linears(root: torch.nn.Module, keep: object) -> int:
    """Store every Linear under ``root`` that ``keep(module, name)`` takes rotated (its weight
    times the Hadamard, in groups), rotating its inputs as they arrive; the output is the
    same product. Returns how many were rotated (a layer no group divides is left alone)."""
    count = 0
    for name, module in root.named_modules():
        if not isinstance(module, torch.nn.Linear) or hasattr(module, ROTATED) or not keep(module, name):  # type: ignore[operator]
            continue
        group = group_for(module.in_features)
        if group:
            with torch.no_grad():
                module.weight.copy_(rotated(module.weight.float(), group).to(module.weight.dtype))
            rotate_inputs(module, group)
            count += 1
    return count


def restore_rotations(root: torch.nn.Module, quantised: object) -> int:
    """After a stored ConvRot model is loaded: rotate the inputs of every Linear
    ``quantised(module)`` says holds a stored (rotated) weight, in the group its width takes."""
    count = 0
    for module in root.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module, ROTATED) and quantised(module):  # type: ignore[operator]
            group = group_for(module.in_features)
            if group:
                rotate_inputs(module, group)
                count += 1
    return count
