"""Quantised-size factors a family can trust: derived from a checkpoint's headers.

A family's table says what its denoiser weighs under each scheme as a factor of its bf16
size (``QuantRules(factors=..., inference_factors=...)``). The generic factors assume every
weight quantises; a denoiser whose weights are partly Conv2d (Sana's feed-forward), norms or
embeddings the filter keeps dense weighs more. This tool reads the tensor names and shapes
of a checkpoint's denoiser (safetensors headers: no weight is read) and sizes each scheme
with the engine's own filter (:func:`engine.policy.quant_filter.quantised_gb`, the rule the
runtime's torchao ``filter_fn`` applies), so the factors it prints are the bytes a build
makes:

- ``factors``: the training build (the filter alone);
- ``inference_factors``: the inference build, which also keeps the table's
  ``int8_dense_modules`` dense (printed where they differ).

Usage::

    python -m engine.testing.quant_factors ./my-model            # a pipeline folder (its denoiser), a
                                                                 # denoiser folder, or a .safetensors file
    python -m engine.testing.quant_factors --family NAME         # the full-size config on the meta device
    python -m engine.testing.quant_factors --family NAME --check # the table's factors against the derived (2%)

Without a checkpoint, ``--family`` builds the denoiser at full size on the meta device from
its ``MemoryProbe`` (``model_class`` and ``full``; no weights, no download).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.contract.plugins import Registry, load_registry
from engine.contract.types import FamilySpec
from engine.policy.quant_filter import LAYOUTS, dense_gb, quantised_gb
from engine.preflight.headers import Shapes, tensor_shapes

#: How far a table's factor may sit from the derived one (relative) before ``--check`` fails.
TOLERANCE = 0.02


@dataclass(frozen=True)
class Factors:
    """A denoiser's bf16 GB and its GB under each scheme, for the training and inference builds."""

    dense_gb: float
    training_gb: dict[str, float]
    inference_gb: dict[str, float] = field(default_factory=dict)

    @property
    def factors(self) -> dict[str, float]:
        return {s: round(gb / self.dense_gb, 3) for s, gb in self.training_gb.items()}

    @property
    def inference_factors(self) -> dict[str, float]:
        """The inference build's factors, only where they differ from the training build's."""
        return {s: round(gb / self.dense_gb, 3) for s, gb in self.inference_gb.items()
                if round(gb / self.dense_gb, 3) != self.factors[s]}

    def literal(self) -> str:
        """The ``QuantRules`` fields to paste into a table."""
        text = f"factors={json.dumps(self.factors)}"
        if self.inference_factors:
            text += f", inference_factors={json.dumps(self.inference_factors)}"
        return text


def factors_of(shapes: Shapes, dense_modules: Sequence[str] = ()) -> Factors:
    """Each scheme's GB of the ``(name, shape)`` tensors, under the engine's filter."""
    dense = dense_gb(shapes)
    if dense <= 0:
        raise ValueError("no tensors: nothing to size")
    inference = {s: quantised_gb(shapes, s, tuple(dense_modules)) for s in LAYOUTS} if dense_modules else {}
    return Factors(dense, {s: quantised_gb(shapes, s) for s in LAYOUTS}, inference)


def checkpoint_shapes(path: Path, spec: FamilySpec | None = None) -> Shapes:
    """The denoiser's tensors of a pipeline folder (its ``spec.pipeline.denoiser`` folder, else the one
    ``model_index.json`` names first among transformer / unet), a denoiser folder or one file."""
    if path.is_file():
        return tensor_shapes([path])
    folder = path
    if (path / "model_index.json").is_file():
        names = [spec.pipeline.denoiser] if spec is not None else []
        names += [n for n in ("transformer", "unet") if n not in names]
        folder = next((path / n for n in names if (path / n).is_dir()), path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors files")
    return tensor_shapes(files)


def full_size_shapes(spec: FamilySpec) -> Shapes:
    """The full-size denoiser's tensors, built on the meta device from the table's ``MemoryProbe``."""
    from engine.testing.memory_models import Denoiser, full_size_model

    model = full_size_model(Denoiser.of(spec))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def table_problems(spec: FamilySpec, derived: Factors, tolerance: float = TOLERANCE) -> list[str]:
    """Where the factor the plan uses sits wrong: a table's own factor further than ``tolerance``
    from the derived one (either way), or a generic factor (none declared) that is smaller than
    the derived one by more than that (the plan would take the denoiser for lighter than it is;
    the generic factors are deliberately a little heavy, which only costs headroom)."""
    from engine.policy.schemes import SCHEME_SIZES

    problems = []
    for scheme, training_gb in derived.training_gb.items():
        for build, inference in (("factors", False), ("inference_factors", True)):
            if inference and scheme not in derived.inference_factors and \
                    scheme not in dict(spec.quantisation.inference_factors):
                continue  # the inference build holds what the training build holds: checked once
            want = (derived.inference_gb.get(scheme, training_gb) if inference else training_gb) / derived.dense_gb
            own = spec.quantisation.factor(scheme, inference=inference)
            if own is not None and abs(own - want) > tolerance * want:
                problems.append(f"{spec.name}: {build}[{scheme}] is {own}, the headers give {want:.3f}")
            elif own is None and SCHEME_SIZES[scheme].steady < want * (1 - tolerance):
                problems.append(f"{spec.name}: {scheme} takes the generic factor {SCHEME_SIZES[scheme].steady}, the "
                                f"headers give {want:.3f}; declare QuantRules({build}={{{scheme!r}: {want:.3f}}})")
    return sorted(set(problems))


def derive(registry: Registry, family: str | None, path: Path | None) -> tuple[FamilySpec | None, Factors]:
    spec = registry.family(family) if family else None
    if path is not None:
        shapes = checkpoint_shapes(path, spec)
    elif spec is not None:
        shapes = full_size_shapes(spec)
    else:
        raise SystemExit("give a checkpoint path, a --family, or both")
    dense_modules = spec.quantisation.int8_dense_modules if spec is not None else ()
    return spec, factors_of(shapes, dense_modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", nargs="?", type=Path, help="a pipeline folder, a denoiser folder or a .safetensors file")
    parser.add_argument("--family", help="the family (its int8_dense_modules; without a path: its full-size config)")
    parser.add_argument("--check", action="store_true", help="fail (exit 1) where the table's factors are off by more "
                        f"than {TOLERANCE:.0%}")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    spec, derived = derive(load_registry(), args.family, args.path)
    if args.json:
        print(json.dumps({"dense_gb": derived.dense_gb, "factors": derived.factors,
                          "inference_factors": derived.inference_factors}, indent=2))
    else:
        print(f"{'scheme':<7} {'GB':>9} {'factor':>7}   (bf16 {derived.dense_gb:.3f} GB)")
        for scheme, gb in derived.training_gb.items():
            print(f"{scheme:<7} {gb:>9.3f} {derived.factors[scheme]:>7.3f}")
        print(f"quantisation=QuantRules({derived.literal()}, ...)")
    problems = table_problems(spec, derived) if args.check and spec is not None else []
    for problem in problems:
        print(f"check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
