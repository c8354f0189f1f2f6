"""Training memory figures for any installed family: derived from a measured LoRA step, and checked.

The supported tool for a family author: ``python -m engine.testing.memory_figures
--derive --families NAME`` prints the ``TrainingMemoryFigures`` literal the
family's table carries (``training=TrainingSpec(memory=...)``), and without
``--derive`` it checks the engine's estimate against what it measures. It
works for every installed family whose table has a ``MemoryProbe``
(``training=TrainingSpec(probe=...)``): the diffusers class, the real
config, two reduced depths and how prompts are fed. A family whose runtime
``predict`` needs more than ``prompt_embeds`` (and ``pooled_prompt_embeds``
when ``pooled_dim`` is set) defines ``probe_conditioning(config,
text_tokens, dtype)`` in its runtime module, and ``probe_pipeline(model)``
where ``predict`` reads helpers from the pipeline.

Each family's denoiser is built with its diffusers class at the real widths
and a reduced depth, and runs one LoRA training step the way
``engine/training/trainer.py`` does it: the frozen base in bf16, a peft LoRA
(rank 16, the family's default targets, fp32 adapter weights, gaussian init),
AdamW on the adapter, the family runtime's own ``predict`` (packing, ids,
timestep conventions), MSE in fp32, backward, gradient clipping, an optimiser
step. The step measured is the *second* one, so AdamW's moments exist, as in
every step of a real run after the first.

How memory is measured. This machine's CPU has no native bf16 matrix unit
(bf16 GEMM runs at well under 1 GFLOP/s here), so a real-width bf16 step
cannot be computed on it. The step therefore runs under torch's
``FakeTensorMode``: every op of the real code runs with its real shapes,
dtypes, autograd graph, SDPA kernel choice, gradient checkpointing and
optimiser, but no data is computed. A ``TorchDispatchMode`` (``LiveBytes``)
counts the bytes of every tensor storage the step creates and frees them
when the storage dies: the live total and its peak, i.e. what a caching
allocator's "allocated" figure reports, less its block rounding. The
``--validate`` pass (also part of the default mode) checks that counter on
real tensors against torch's own CPU allocator accounting (the profiler's
``profile_memory`` "Total Allocated" running figure), at narrow widths in
fp32 where real compute is affordable, and checks that the counter reads the
same under fake tensors as under real ones.

Where the CPU path differs from the GPU trainer, the GPU path is reproduced:
the trainer routes diffusers' ``RMSNorm`` through the fused CUDA
``rms_norm`` (saves its input and an fp32 ``rstd``); torch's CPU ``rms_norm``
is a decomposition that saves fp32 intermediates, so the bench runs a
stand-in with the fused kernel's saved tensors. SDPA without a mask takes
torch's CPU flash kernel, which saves what CUDA flash saves (q, k, v, out
and an fp32 log-sum-exp); the ops taken are printed.

Modes:

``--derive``: solves the per-token figures (``ActivationFigures``) of each
family from the step's activation peak at two resolutions (256, 512 px) and
two prompt lengths, with and without gradient checkpointing. What one block
adds is the difference between two reduced depths (a family whose probe has
no ``deeper`` depth, a UNet that keeps its channel mix at one reduced depth
only: hooks around each block); the rest is "outside", the backward's transient at the peak included.
The full-size LoRA target shapes are read from the full config on the meta
device. Prints the literals the family tables carry.

default: the accuracy check, at a third reduced depth (not one the figures
came from) and at full size, 256/512 px (512/1024 full size), with and
without checkpointing: measured vs
``engine.policy.training_memory.estimate_training_memory`` per component
(the estimate given this model's block count, LoRA shapes and measured
weight bytes), plus one no-grad inference forward (measured only).

    nice -n 10 python -m engine.testing.memory_figures --derive [--families NAME ...]
    nice -n 10 python -m engine.testing.memory_figures [--families NAME ...] [--validate | --skip-validation]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from engine.errors import EngineError
from engine.policy.training_memory import (
    BaseFacts,
    TrainingShape,
    estimate_training_memory,
    lora_target_shapes,
)
from engine.testing.memory_measure import RANK, Measured, measure_step
from engine.testing.memory_models import (  # Denoiser and NoProbe: the tool's names, as before the split
    Denoiser,
    NoProbe,
    _config,
    count_blocks,
    full_lora_targets,
)
from engine.contract.types import ActivationFigures, TrainingMemoryFigures

#: Whether ActivationFigures carries its own outside figures under checkpointing.
SEPARATE_CHECKPOINTED_OUTSIDE = any(
    f.name == "checkpointed_outside_per_image_token" for f in dataclasses.fields(ActivationFigures)
)
GB = 1e9


def _solve(rows: list[tuple[float, float]], values: list[float]) -> tuple[float, float, float, float]:
    """Least squares ``value = a * image + b * text + c``; returns a, b, c and the worst residual."""
    a = torch.tensor([[i, t, 1.0] for i, t in rows], dtype=torch.float64)
    y = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, y).solution.squeeze(1)
    residual = float((a @ coef.unsqueeze(1) - y).abs().max())
    return float(coef[0]), float(coef[1]), float(coef[2]), residual


def derive(d: Denoiser, resolutions: tuple[int, ...], log: Callable[[str], None]) -> TrainingMemoryFigures:
    """Per-token figures from the step's activation peak at two resolutions and
    two prompt lengths (least squares over image tokens, text tokens and a
    constant, which should come out near zero).

    What a block adds is the difference between two depths where a family
    has them: a block's forward hooks would also count tensors a later block
    frees (single-stream blocks may hand on views the next one concatenates).
    A probe with no ``deeper`` depth (a UNet with no smaller depth that keeps
    its channel mix) has its blocks measured by hooks around each one.
    """
    n_blocks = count_blocks(d, _config(d, d.derive))
    n_deeper = count_blocks(d, _config(d, d.deeper)) if d.deeper is not None else 0
    texts = (d.text_tokens, d.text_tokens // 2)
    rows, per_block, kept, outside, outside_ckpt = [], [], [], [], []
    for resolution in resolutions:
        for text in texts:
            frames = d.probe.frames
            plain, _ = measure_step(d, d.derive, resolution, text, False, frames=frames)
            ckpt, _ = measure_step(d, d.derive, resolution, text, True, frames=frames)
            seconds = plain.seconds + ckpt.seconds
            if d.deeper is not None:
                plain_b, _ = measure_step(d, d.deeper, resolution, text, False, frames=frames)
                ckpt_b, _ = measure_step(d, d.deeper, resolution, text, True, frames=frames)
                seconds += plain_b.seconds + ckpt_b.seconds
                added = n_deeper - n_blocks
                block = (plain_b.activations_peak - plain.activations_peak) / added / 2  # elements (bf16)
                block_kept = (ckpt_b.activations_peak - ckpt.activations_peak) / added / 2
            else:
                block = sum(plain.blocks) / n_blocks / 2
                block_kept = sum(ckpt.blocks) / n_blocks / 2
            # Outside the blocks: what the forward keeps there plus the backward's
            # own transient at the peak (it does not grow with depth); under
            # checkpointing one block is recomputed in full on top.
            rest = plain.activations_peak / 2 - n_blocks * block
            rest_ckpt = ckpt.activations_peak / 2 - n_blocks * block_kept - block
            image = d.spec.rendering.geometry.clip_tokens(frames, resolution)  # as the estimate counts them
            rows.append((image, text))
            per_block.append(block)
            kept.append(block_kept)
            outside.append(rest)
            outside_ckpt.append(rest_ckpt)
            tokens = image + text
            log(f"  {d.family:<10} {resolution:>4}px text {text:>3}: block {block / tokens:7.1f} el/token, "
                f"ckpt block {block_kept / tokens:6.1f}, outside {rest / tokens:7.1f} "
                f"(ckpt run {rest_ckpt / tokens:7.1f}); fwd kept {plain.forward_kept / GB:.3f} GB, "
                f"peak {plain.peak / GB:.2f} GB; ops {plain.ops} [{seconds:.0f} s]")
    fits = {}
    series = (("block", per_block), ("kept", kept), ("outside", outside), ("outside_ckpt", outside_ckpt))
    for name, values in series:
        a, b, c, residual = _solve(rows, values)
        fits[name] = (a, b)
        log(f"  {d.family:<10} fit {name:<12} {a:9.1f} el/image token {b:8.1f} el/text token, "
            f"constant {c * 2 / 1e6:7.2f} MB, worst residual {residual * 2 / 1e6:.2f} MB")
    values = dict(
        block_per_image_token=round(fits["block"][0], 1),
        block_per_text_token=round(fits["block"][1], 1),
        checkpointed_block_per_image_token=round(fits["kept"][0], 1),
        checkpointed_block_per_text_token=round(fits["kept"][1], 1),
        outside_per_image_token=round(fits["outside"][0], 1),
        outside_per_text_token=round(fits["outside"][1], 1),
        blocks=count_blocks(d, _config(d, {})),
        text_tokens=d.text_tokens,
    )
    if SEPARATE_CHECKPOINTED_OUTSIDE:
        values["checkpointed_outside_per_image_token"] = round(fits["outside_ckpt"][0], 1)
        values["checkpointed_outside_per_text_token"] = round(fits["outside_ckpt"][1], 1)
    else:
        # One outside figure serves both modes: the larger, so neither is
        # under-sized. (Where checkpointing also covers modules outside the
        # repeated blocks, a UNet's resnets, the checkpointed run is then over.)
        values["outside_per_image_token"] = round(max(fits["outside"][0], fits["outside_ckpt"][0]), 1)
        values["outside_per_text_token"] = round(max(fits["outside"][1], fits["outside_ckpt"][1]), 1)
        log(f"  {d.family:<10} checkpointed outside (no field for it in ActivationFigures): "
            f"{fits['outside_ckpt'][0]:.1f} el/image token, {fits['outside_ckpt'][1]:.1f} el/text token")
    activations = ActivationFigures(**values)
    return TrainingMemoryFigures(activations=activations, lora_targets=full_lora_targets(d))


def literal(figures: TrainingMemoryFigures) -> str:
    """The figures as the table writes them, inside ``training=TrainingSpec(...)``."""
    a = figures.activations
    fields = "\n".join(f"                {f.name}={getattr(a, f.name)!r}," for f in dataclasses.fields(a))
    targets = "\n".join(
        f"                LoraTargetShape({t.target!r}, {t.in_features}, {t.out_features}, {t.count}),"
        for t in figures.lora_targets
    )
    return (f"        memory=TrainingMemoryFigures(\n            activations=ActivationFigures(\n{fields}\n"
            f"            ),\n            lora_targets=(\n{targets}\n            ),\n        ),")


# ---------------------------------------------------------------------------
# the accuracy check
# ---------------------------------------------------------------------------


def estimate_for(d: Denoiser, config: dict[str, Any], m: Measured, extra: dict[str, Any],
                 resolution: int, text: int, checkpointing: bool, frames: int = 1):  # type: ignore[no-untyped-def]
    """The engine's estimate for this reduced model: the family's figures with
    this model's block count, prompt length and LoRA target shapes, and the
    measured weight bytes as the base."""
    spec = d.spec
    figures = spec.training.memory
    if figures is None:
        raise SystemExit(f"{d.family}: no training.memory figures in its table; run --derive first")
    targets = lora_target_shapes(extra["base_shapes"], spec.lora.targets)
    own = replace(
        figures,
        activations=replace(figures.activations, blocks=count_blocks(d, config), text_tokens=text),
        lora_targets=targets,
    )
    family = replace(spec, training=replace(spec.training, memory=own))
    base = BaseFacts(dense_gb=m.weights / GB, text_encoders_gb=0.0, vae_gb=0.0, source="measured")
    shape = TrainingShape(resolution=resolution, frames=frames, lora_rank=RANK, gradient_checkpointing=checkpointing)
    return estimate_training_memory(family, base, "bf16", shape)


def _err(estimated: float, measured: float) -> str:
    return f"{(estimated - measured) / measured * 100:+6.1f}%" if measured else "   n/a"


def check(d: Denoiser, depth: str, resolutions: tuple[int, ...], log: Callable[[str], None]) -> list[float]:
    overrides = d.check if depth == "reduced" else {}
    config = _config(d, overrides)
    errors = []
    for resolution, frames in ((r, f) for r in resolutions for f in d.probe.check_frames or (d.probe.frames,)):
        inference = 0  # the no-grad forward does not depend on checkpointing: measured once
        for checkpointing in (False, True):
            m, extra = measure_step(d, overrides, resolution, d.text_tokens, checkpointing, frames=frames,
                                    inference=not inference)
            inference = m.inference_peak = m.inference_peak or inference
            est = estimate_for(d, config, m, extra, resolution, d.text_tokens, checkpointing, frames)
            peak_est = est.training_peak_gb - est.overhead_gb  # allocated bytes, no CUDA context
            lora_meas = m.lora_state / GB
            cells = [
                (est.base_gb, m.weights / GB), (est.lora_gb, lora_meas),
                (est.activations_gb, m.activations_peak / GB), (peak_est, m.peak / GB),
            ]
            errors += [abs(e - me) / me * 100 for e, me in cells[2:] if me]
            text = "  ".join(f"{me:7.3f} {e:7.3f} {_err(e, me)}" for e, me in cells)
            log(f"| {d.family:<10} | {depth:<7} {count_blocks(d, config):>3} | {resolution:>4}"
                + (f" x{frames:>3}f" if frames > 1 else "") + " | "
                f"{'yes' if checkpointing else 'no ':<3} | {text} | {m.inference_peak / GB:7.3f} | "
                f"{m.seconds:4.0f}s")
    return errors


def validate(d: Denoiser, log: Callable[[str], None]) -> None:
    """The counter against the CPU allocator (real tensors, fp32, narrow widths),
    and the counter on real vs fake tensors."""
    for checkpointing in (False, True):
        real, extra = measure_step(
            d, d.narrow, 128, 32, checkpointing, dtype=torch.float32, fake=False, profile=True
        )
        fake, fextra = measure_step(d, d.narrow, 128, 32, checkpointing, dtype=torch.float32, fake=True)
        log(f"  {d.family:<10} ckpt {'yes' if checkpointing else 'no '}: step high-water "
            f"profiler {extra['profiler_peak'] / 1e6:8.2f} MB, counter {extra['tracker_peak'] / 1e6:8.2f} MB "
            f"({_err(extra['tracker_peak'], extra['profiler_peak'])}), counter on fake tensors "
            f"{fextra['tracker_peak'] / 1e6:8.2f} MB ({_err(fextra['tracker_peak'], extra['tracker_peak'])}) "
            f"[{real.seconds:.0f} s]")


def main(argv: list[str] | None = None) -> None:
    from engine.contract.plugins import load_registry

    registry = load_registry()
    probed = [name for name, spec in registry.families.items() if spec.training.probe is not None]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=probed,
                        help=f"installed families with a memory probe (default: all of them: {', '.join(probed)})")
    parser.add_argument("--derive", action="store_true", help="derive the table figures")
    parser.add_argument("--validate", action="store_true", help="only validate the counter")
    parser.add_argument("--skip-validation", action="store_true", help="check without validating the counter")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        chosen = [Denoiser.of(registry.family(name)) for name in args.families]
    except (NoProbe, EngineError) as exc:
        raise SystemExit(f"error: {exc}") from None
    log("memory counted: bytes of live tensor storages (LiveBytes, a TorchDispatchMode) over a bf16 step "
        "run under FakeTensorMode; validated against the CPU allocator's profiler 'Total Allocated'")
    if args.validate or not (args.derive or args.skip_validation):
        log("validation (real fp32 tensors, narrow widths, 128 px, 32 text tokens):")
        for d in chosen:
            validate(d, log)
        if args.validate:
            return
    if args.derive:
        for d in chosen:
            log(f"deriving {d.family} ({d.model_class}, {_describe(d.derive)}, "
                f"{count_blocks(d, _config(d, d.derive))} blocks):")
            figures = derive(d, (256, 512), log)
            log(f"# {d.family}: python -m engine.testing.memory_figures --derive\n{literal(figures)}")
        return
    log("\nGB measured / estimated / error: base weights, LoRA (params+grads+AdamW), activations "
        "(step high-water less LoRA grads), peak allocated (estimate less its runtime overhead); "
        "inference = weights + no-grad forward high-water, measured")
    log("| family | depth blocks | px | ckpt | base meas est err | LoRA meas est err | "
        "activations meas est err | peak meas est err | inference | time |")
    worst = 0.0
    for d in chosen:
        for depth, resolutions in (("reduced", (256, 512)), ("full", (512, 1024))):
            if depth == "reduced" and not d.check:
                continue
            errors = check(d, depth, resolutions, log)
            worst = max([worst, *errors])
    log(f"worst activation/peak error: {worst:.1f}%")


def _describe(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


if __name__ == "__main__":
    main()
