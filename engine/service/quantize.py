"""Quantise a pipeline's denoiser once and keep it: ``diffusion-engine quantize`` and ``Engine.quantize``.

The output is a pipeline folder that loads like the original: every other
component hard-linked (or copied) from it, the denoiser (and a second
expert) stored as torchao tensors in safetensors with a marker naming the
scheme, the device it was made for, its source and its dense size
(:mod:`engine.runtime.prequantised`). The same filter and torchao config a
load-time quantisation uses on that device make it, so the stored model
renders what quantising at load renders, and loading it skips the bf16
transient and the quantisation time.

Every check runs before anything is read into memory: the model is a local
pipeline folder (not already quantised), the scheme is one the folder can
store and the family allows for inference, fp8 has its hardware, and the
output is a new (or empty) folder that can be written. The job holds the
engine's job slot, so it never runs beside a generate or a training run.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from engine.contract.plugins import Registry
from engine.errors import PreflightError
from engine.places import within
from engine.preflight.model import resolve_model
from engine.preflight.quantised_folder import STORED_SCHEMES
from engine.preflight.source import ModelSource
from engine.service.machine import Machine
from engine.service.slot import JobSlot
from engine.training.output_dir import check_new_folder


class Quantizer:
    """``Engine.quantize``: checks, then writes the pre-quantised folder."""

    def __init__(self, registry: Registry, machine: Machine, slot: JobSlot) -> None:
        self._registry, self._machine, self._slot = registry, machine, slot

    def check(self, model: str, scheme: str, output: str | Path, *, device: str = "auto") -> tuple[ModelSource, str, Path]:
        """The source, the device and the output folder, or the refusal (nothing read into memory)."""
        if scheme not in STORED_SCHEMES:
            raise PreflightError(f"scheme={scheme}: a quantised folder stores {' or '.join(STORED_SCHEMES)} "
                                 "(nf4 checkpoints are bitsandbytes', quantised at load)", code="invalid_request")
        source = resolve_model(self._registry, model, allow_hub=False)
        if source.kind != "pipeline":
            raise PreflightError(f"{model} is a {source.kind.replace('_', ' ')}; quantize takes a diffusers "
                                 "pipeline folder (with model_index.json)", code="not_a_pipeline")
        if source.prequantised_scheme is not None:
            raise PreflightError(f"{model} is already stored quantised ({source.prequantised_scheme}); quantise "
                                 "the model it was made from", code="prequantised_model")
        family = source.family
        denied = dict(self._registry.quant_deny_reasons(family, "inference")).get(scheme)
        if denied:
            raise PreflightError(f"scheme={scheme}: {family.label} is not quantised {scheme} ({denied})",
                                 code="quant_denied")
        hardware = self._machine.hardware()
        target = ("cuda" if hardware.cuda else "cpu") if device == "auto" else device
        if target == "cuda" and not hardware.cuda:
            raise PreflightError(f"device=cuda: {hardware.device_name} has no CUDA device; use --device cpu",
                                 code="needs_cuda")
        if scheme == "fp8" and not (target == "cuda" and hardware.fp8):
            raise PreflightError("scheme=fp8 needs a GPU with fp8 (compute capability 8.9 or newer); "
                                 "use --scheme int8 here", code="fp8_unsupported")
        folder = Path(output).expanduser().absolute()
        check_new_folder(folder, "output", "quantize")
        return source, target, folder

    def _dtype(self, target: str) -> str:
        """The dtype the folder is made in: a GPU's bf16, or the dtype a CPU plan computes in by
        default here (bf16 where it multiplies it natively), so the folder renders what quantising
        at load renders."""
        if target != "cpu":
            return "bf16"
        from engine.policy.cpu_kernel import cpu_dtype

        return cpu_dtype(self._machine.hardware(), fp32_fits=True, exact=False).value

    def quantize(self, model: str, scheme: str, output: str | Path, *, device: str = "auto") -> dict[str, object]:
        """Write ``output``: ``model``'s pipeline with its denoiser(s) stored ``scheme``; what was written."""
        source, target, folder = self.check(model, scheme, output, device=device)
        self._slot.reserve("quantizing")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return _write(source, scheme, target, folder, self._dtype(target))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            self._slot.release("quantizing")


def _write(source: ModelSource, scheme: str, device: str, folder: Path, dtype_name: str) -> dict[str, object]:
    import diffusers
    import torch
    import torchao

    from engine.runtime import quantize
    from engine.runtime.prequantised import save_quantised

    started = time.perf_counter()
    root, family = Path(source.location), source.family
    config = diffusers.DiffusionPipeline.load_config(str(root))
    stored = [name for name in (family.pipeline.denoiser, *family.pipeline.experts)
              if isinstance(config.get(name), list) and config[name][0]]
    _link_tree(root, folder, skip=set(stored))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    keep = quantize.module_filter(scheme, family.quantisation.int8_dense_modules)
    layers = 0
    dense_gb = source.measured_sizes.transformer_gb if source.measured_sizes else None
    for name in stored:
        model = getattr(diffusers, config[name][1]).from_pretrained(str(root), subfolder=name, dtype=dtype)
        placed = quantize.quantize_on_host_then_place(model, scheme, device, resident=False, keep=keep)
        layers += placed.layers
        save_quantised(model.to("cpu"), folder / name, {
            "scheme": scheme, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "made_from": str(root), "torchao": torchao.__version__, "layers": placed.layers,
            "dense_gb": dense_gb, "model_class": config[name][1],
        })
        del model
    return {"output": str(folder), "scheme": scheme, "device": device, "quantised": stored, "layers": layers,
            "seconds": round(time.perf_counter() - started, 2)}


def _link_tree(source: Path, target: Path, skip: set[str]) -> None:
    """Every file of ``source`` but the ``skip`` components, hard-linked where the filesystem allows;
    only what resolves inside ``source`` (a symlink leading out of it is left behind)."""
    for folder, dirs, files in os.walk(source):
        relative = Path(folder).relative_to(source)
        if relative.parts and relative.parts[0] in skip:
            dirs[:] = []
            continue
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            if not within(source, Path(folder) / name, strictly=True):
                continue  # a link leading out of the model folder: never copied into the output
            try:
                os.link(Path(folder) / name, target / relative / name)
            except OSError:
                shutil.copy2(Path(folder) / name, target / relative / name)


__all__ = ["Quantizer"]
