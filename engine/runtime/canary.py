"""The numeric canary: one small forward of a real slice of the model, in the
chosen scheme and compute dtype, before a long job relies on them.

A scheme can pass every capability gate and still render black (an fp8 GEMM
on a model whose activations exceed its range, fp16 on a model that needs
bf16). The planner cannot see that; one Linear of the real denoiser, run the
way the job will run it, can: its output must be finite and not constant.

- Inference: after the transformer is quantised, the first converted Linear
  of its first block runs where it was placed (a dense fp16 load: on the
  host, in fp16, before placing). A failure is a :class:`CanaryFailed` (a
  quantisation failure), so the loader builds the plan's fallback with the
  reason and the measured values, before any image; with no fallback the
  load is refused with them.
- nf4 (bitsandbytes) is checked in the run's compute dtype, not through the
  4-bit kernel: the canary reads the dense weight from the files.
- Training (:mod:`engine.training.canary`): before anything is evicted, the
  same Linear is read from the base's safetensors (:func:`read_linear`), set
  up in the run's base precision on the run's device and run; a failure
  refuses the start.

Its cost is one read of one weight and one forward of
:data:`CANARY_ROWS` rows: milliseconds, well under 2% of a long run; it is
reported with the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.runtime.quantize import QuantisationFailed

#: Rows of the canary's input: enough for a spread of outputs, cheap anywhere.
CANARY_ROWS = 16
#: A weight larger than this is not read for the canary (the next candidate is).
MAX_SLICE_ELEMENTS = 64 * 2**20
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

ModuleFilter = Callable[[torch.nn.Module, str], bool]


@dataclass(frozen=True)
class CanaryResult:
    """What the canary ran and measured; ``ok`` False means the scheme is broken here."""

    ok: bool
    scheme: str
    dtype: str
    device: str
    #: The Linear it ran (its name in the denoiser), or None when skipped.
    layer: str | None = None
    skipped: bool = False
    reason: str = ""
    #: Measured on the output: finite fraction, min, max, std.
    values: dict[str, float] = field(default_factory=dict)
    cost_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class CanaryFailed(QuantisationFailed):
    """The scheme ran on a real slice of the model and produced unusable output."""

    code = "canary_failed"

    def __init__(self, result: CanaryResult) -> None:
        super().__init__(result.reason)
        self.result = result


def measure(output: torch.Tensor) -> dict[str, float]:
    """Finite fraction, min, max and std of ``output`` (over its finite values)."""
    values = output.detach().float()
    finite = torch.isfinite(values)
    kept = values[finite]
    measured = {"finite_fraction": round(float(finite.float().mean()), 4)}
    if kept.numel():
        measured |= {"min": float(kept.min()), "max": float(kept.max()), "std": float(kept.std()) if kept.numel() > 1 else 0.0}
    return measured


#: What a quantised layer's forward raises where its kernel cannot run here.
_KERNEL_ERRORS = (RuntimeError, ValueError, NotImplementedError, TypeError, AssertionError)


def run_linear(
    layer: torch.nn.Module, name: str, *, scheme: str, dtype: torch.dtype, device: torch.device | str
) -> CanaryResult:
    """Forward :data:`CANARY_ROWS` unit-variance rows through ``layer``; judge the output."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(CANARY_ROWS, layer.in_features, generator=generator)  # type: ignore[arg-type]
    label = str(dtype).removeprefix("torch.")
    where = f"{name} ({scheme}, {label} compute on {device})"
    try:
        with torch.no_grad():
            output = layer(inputs.to(device=device, dtype=dtype))
    except _KERNEL_ERRORS as exc:  # a kernel this machine cannot run (torchao's mxfp8 GEMM on a CPU)
        return CanaryResult(ok=False, scheme=scheme, dtype=label, device=str(device), layer=name,
                            reason=f"the {scheme} canary could not run {where}: {str(exc).splitlines()[0][:200]}",
                            values={}, cost_s=round(time.perf_counter() - started, 4))
    values = measure(output)
    finite = values["finite_fraction"] == 1.0
    constant = finite and values.get("std", 0.0) == 0.0
    if not finite:
        reason = f"the {scheme} canary produced non-finite output on {where}: {values}"
    elif constant:
        reason = f"the {scheme} canary produced a constant output on {where}: {values}"
    else:
        reason = f"{where}: finite, not constant"
    return CanaryResult(
        ok=finite and not constant, scheme=scheme, dtype=label, device=str(device), layer=name,
        reason=reason, values=values, cost_s=round(time.perf_counter() - started, 4),
    )


def pick_linear(model: torch.nn.Module, keep: ModuleFilter) -> tuple[str, torch.nn.Module] | None:
    """The Linear the canary runs: the first one ``keep`` takes in the first
    repeated block (``...blocks.0.``), else the first one it takes at all."""
    chosen = [(name, module) for name, module in model.named_modules() if keep(module, name)]
    first_block = [(n, m) for n, m in chosen if "blocks.0." in f"{n}."]
    return (first_block or chosen or [None])[0]


def inference_canary(
    denoiser: torch.nn.Module, keep: ModuleFilter, *, scheme: str, dtype: torch.dtype
) -> CanaryResult:
    """Run the canary on the loaded (quantised) denoiser; raise :class:`CanaryFailed` on bad output."""
    picked = pick_linear(denoiser, keep)
    if picked is None:
        return CanaryResult(True, scheme, str(dtype), "-", skipped=True, reason="no Linear the scheme converts")
    name, layer = picked
    device = next(layer.parameters()).device
    result = run_linear(layer, name, scheme=scheme, dtype=dtype, device=device)
    if not result.ok:
        raise CanaryFailed(result)
    return result


def read_linear(folder: Path, keep: ModuleFilter) -> tuple[str, torch.nn.Linear] | None:
    """The canary's Linear, rebuilt from the denoiser's safetensors (one weight read)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    shapes: list[tuple[str, Path, tuple[int, ...]]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.endswith(".weight"):
                    shape = tuple(handle.get_slice(key).get_shape())
                    if len(shape) == 2 and shape[0] * shape[1] <= MAX_SLICE_ELEMENTS:
                        shapes.append((key.removesuffix(".weight"), file, shape))
    candidates = []
    for name, file, (out_features, in_features) in shapes:
        probe = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
        probe.requires_grad_(False)
        if keep(probe, name):
            candidates.append((name, file))
    first_block = [c for c in candidates if "blocks.0." in f"{c[0]}."]
    if not candidates:
        return None
    name, file = (first_block or candidates)[0]
    with safe_open(str(file), framework="pt") as handle:
        weight = handle.get_tensor(f"{name}.weight")
        bias = handle.get_tensor(f"{name}.bias") if f"{name}.bias" in handle.keys() else None  # noqa: SIM118
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.requires_grad_(False)
    return name, layer


