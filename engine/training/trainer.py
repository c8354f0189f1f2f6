"""The one LoRA trainer loop every family plugs into.

The loop is generic: load the base pipeline, cache latents and prompt
embeddings, add a peft LoRA to the denoiser, set up the base precision on the
host and only then move the denoiser to the device (a quantised base is never
on the GPU in dense bf16; the ``placing`` phase event and the ``started``
event say which path was taken), and optimise with AdamW, an LR schedule and
gradient clipping (reporting the pre-clip norm). The family's runtime
module (named by its training objective) supplies ``encode_prompts``,
``encode_images`` and ``predict``; the objective says how to noise and what
to regress: flow matching (target = noise - x0 at sigma) or epsilon / v
prediction on a DDPM schedule. Under accelerate (``gpus`` > 1) the same loop
runs on every rank; :mod:`engine.training.replicas` shards the global batch
and syncs gradients, stops and the loss.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine.runtime import family_hooks
from engine.errors import EngineError
from engine.contract.family_runtime import load_runtime
from engine.runtime import flags
from engine.training.precision import check_this_machine, pinned_sdpa, place_base, rms_norm_patch
from engine.training.buckets import epoch_batches
from engine.training.captions import CaptionOptions
from engine.training.base_loading import load_base, load_denoisers
from engine.training import sound
from engine.training.inputs import Captions, cache_inputs, prompt_row
from engine.contract.plugins import Registry, load_registry
from engine.training import levers
from engine.training.preflight import TrainingPlan
from engine.training.export import save_lora
from engine.training.run_state import restore_run_state, save_run_state
from engine.training.replicas import SOLO, Replicas, StopCheck, example_generators

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Emit = Callable[[dict[str, object]], None]


class _StoppedEarly(Exception):
    """A stop request that arrived before training began (loading, caching): nothing to save."""

    def __init__(self, request: str) -> None:
        super().__init__(request)
        self.request = request


def run_training(
    plan: TrainingPlan, output_dir: Path, emit: Emit, should_stop: StopCheck, registry: Registry | None = None,
    replicas: Replicas = SOLO,
) -> dict[str, object]:
    """Train; emit events; return the terminal event (completed / stopped / cancelled).

    A stop is honoured in every phase: between loading and caching, between
    cached images, and after every optimizer step. ``replicas``: this
    process's rank under accelerate (see :mod:`engine.training.replicas`);
    only rank 0 writes files, and every rank stops where rank 0 does.
    """
    # The plan may have been made for another machine (a preset): re-check
    # this process's own device before anything is loaded.
    check_this_machine(plan.device, plan.weight_dtype.value, plan.family.label)
    snapshot = flags.snapshot()
    fused_norm = rms_norm_patch() if plan.device == "cuda" else contextlib.nullcontext()
    try:
        with pinned_sdpa(plan.device), fused_norm:
            return _train(plan, output_dir, emit, replicas.stop(should_stop), registry or load_registry(), replicas)
    except _StoppedEarly as early:
        kind = "cancelled" if early.request == "cancel" else "stopped"
        return {"type": kind, "step": 0, "outputs": {}}
    finally:
        snapshot.restore()


def _check_stop(should_stop: StopCheck) -> None:
    request = should_stop()
    if request is not None:
        raise _StoppedEarly(request)


def _train(
    plan: TrainingPlan, output_dir: Path, emit: Emit, should_stop: StopCheck, registry: Registry,
    replicas: Replicas = SOLO,
) -> dict[str, object]:
    """Set the run up, resume where asked, step until done or stopped, and save."""
    run = _set_up(plan, emit, should_stop, registry, replicas)
    step = 0
    if plan.config.resume_from is not None:
        step, run.order = restore_run_state(Path(plan.config.resume_from), run.denoiser, run.optimizer, run.schedule,
                                  run.generator, run.scaler, run.ema)
        emit({"type": "phase", "phase": "training", "message": f"resumed from step {step}"})
    _check_stop(should_stop)
    stop: str | None = None
    for step in range(step + 1, plan.steps + 1):
        emit(_optimizer_step(plan, run, step, replicas, output_dir))
        stop = should_stop()
        if replicas.main and plan.config.save_every and (step % plan.config.save_every == 0 or stop == "save"):
            path = save_run_state(plan, run.pipe, run.denoiser, output_dir, step, run.optimizer, run.schedule,
                               run.generator, run.order, run.scaler, registry, run.ema)
            emit({"type": "checkpoint", "step": step, "path": str(path)})
        if replicas.main and plan.config.sample_every and step % plan.config.sample_every == 0:
            from engine.training.samples import write_samples

            emit({"type": "samples", "step": step,
                  "samples": write_samples(plan, run.pipe, run.denoiser, output_dir, step)})
        if stop is not None:
            break
    return _finish(plan, run, step, stop, output_dir, registry, replicas)


@dataclass
class _Run:
    """What the loop trains with, built once by :func:`_set_up`; ``order`` is
    the batches still to come this epoch, each within one bucket."""

    pipe: Any
    runtime: ModuleType
    denoiser: torch.nn.Module
    forward: torch.nn.Module
    params: list[torch.nn.Parameter]
    latents: list[torch.Tensor]
    conditioning: dict[str, torch.Tensor]
    captions: Captions
    groups: list[list[int]]
    chosen: levers.TrainingLevers
    optimizer: torch.optim.Optimizer
    schedule: Any
    ema: levers.LoraEma | None
    noise_schedule: Any
    generator: torch.Generator
    scaler: torch.amp.GradScaler
    #: Each clip's sound, where the family trains it beside the picture.
    sound: sound.SoundInputs | None = None
    order: list[list[int]] = field(default_factory=list)


def _set_up(plan: TrainingPlan, emit: Emit, should_stop: StopCheck, registry: Registry, replicas: Replicas) -> _Run:
    """Load, cache the inputs, add the LoRA, place the base, and build the optimiser."""
    config = plan.config
    device = torch.device(plan.device)
    dtype = TORCH_DTYPES[plan.weight_dtype.value]
    runtime = load_runtime(plan.family, flow_matching=plan.objective.prediction == "flow_matching")
    torch.manual_seed(config.seed)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    emit({"type": "phase", "phase": "loading", "message": f"loading {plan.base.location}"})
    pipe = load_base(plan, dtype)
    _check_stop(should_stop)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False)
    emit({"type": "phase", "phase": "caching", "message": "encoding images and captions",
          "dataset": plan.dataset.to_dict(), "buckets": plan.buckets.to_dict() if plan.buckets else None})
    latents, conditioning, captions = cache_inputs(plan, pipe, runtime, device, dtype, lambda: _check_stop(should_stop))
    sounds = sound.cache_sounds(plan, pipe, runtime, device, dtype, lambda: _check_stop(should_stop))
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in plan.trained_components:
            component.to("cpu")  # the encoders are done: give their memory back
    load_denoisers(plan, pipe, dtype)
    _check_stop(should_stop)
    trained = {name: getattr(pipe, name) for name in plan.trained_components}
    placement = None
    for module in trained.values():
        added = _add_lora(plan, module, registry)  # on the host: the base is converted after the adapter is in
        placement = place_base(module, plan.base_precision.value, plan.device) or placement
    if placement is not None:
        emit({"type": "phase", "phase": "placing", "message": placement.path})
    denoiser = _trained_module(plan, pipe, list(trained.values()))
    params = [p for p in denoiser.parameters() if p.requires_grad]  # as placed on the device
    if plan.gradient_checkpointing.value and hasattr(denoiser, "enable_gradient_checkpointing"):
        denoiser.enable_gradient_checkpointing()
    forward = replicas.prepare(_compiled(plan, denoiser))  # DDP under accelerate: gradients sync in backward
    denoiser.train()
    chosen = levers.of(plan)
    optimizer = levers.build_optimizer(str(chosen.optimizer.value), params, float(chosen.learning_rate.value))
    from diffusers.optimization import get_scheduler

    run = _Run(
        pipe=pipe, runtime=runtime, denoiser=denoiser, forward=forward, params=params, latents=latents,
        conditioning=conditioning, captions=captions,
        groups=plan.buckets.groups() if plan.buckets else [list(range(len(latents)))],
        chosen=chosen, optimizer=optimizer,
        schedule=get_scheduler(chosen.lr_scheduler.value, optimizer,
                               num_warmup_steps=int(chosen.warmup_steps.value), num_training_steps=plan.steps),
        ema=levers.LoraEma(params, chosen.ema.value) if chosen.ema.value is not None else None,
        noise_schedule=runtime.training_scheduler(pipe) if plan.objective.prediction != "flow_matching" else None,
        generator=torch.Generator().manual_seed(config.seed),
        scaler=_grad_scaler(plan), sound=sounds,
    )
    emit({"type": "started", "steps": plan.steps, "lora_adapter": added, "trainable_params": sum(p.numel() for p in params),
          "quantised_layers": placement.layers if placement is not None else 0,
          "base_placement": placement.to_dict() if placement is not None else None})
    return run


def _optimizer_step(plan: TrainingPlan, run: _Run, step: int, replicas: Replicas, output_dir: Path) -> dict[str, object]:
    """One optimiser step over the global batch (accumulated micro-batches); its progress event."""
    config, chosen = plan.config, run.chosen
    device, dtype = torch.device(plan.device), TORCH_DTYPES[plan.weight_dtype.value]
    options = CaptionOptions.from_config(config)
    started = time.perf_counter()
    total_loss, seen, per_step = 0.0, 0, config.batch_size * replicas.world  # the global batch
    part_losses: dict[str, float] = {}
    for micro in range(config.grad_accumulation):
        if not run.order:
            run.order = epoch_batches(run.groups, per_step,
                                      lambda n: torch.randperm(n, generator=run.generator).tolist())
        batch, run.order = run.order[0], run.order[1:]
        shard, weight = replicas.shard(batch, config.batch_size)  # this rank's (slot, image) pairs
        slots = [micro * per_step + slot for slot, _ in shard]
        x0 = torch.stack([run.latents[image] for _, image in shard]).to(device, dtype)
        rows = [prompt_row(run.captions, options, config.seed, step, slot, image)
                for slot, (_, image) in zip(slots, shard)]
        cond = {k: v[rows].to(device) for k, v in run.conditioning.items()}
        draws = example_generators(config.seed, step, slots)
        noisy, timesteps, target = _noise(plan, x0, run.noise_schedule, draws, chosen.flow_shift.value,
                                          plan.expert.value.sigma_range() if plan.expert else (0.0, 1.0))
        with replicas.no_sync(run.forward, last=micro == config.grad_accumulation - 1):
            loss, parts = _loss(plan, run, noisy, timesteps, target, cond, [image for _, image in shard], draws)
            loss = loss * weight
            replicas.backward(run.scaler.scale(loss / config.grad_accumulation))
        total_loss += loss.item() / replicas.world / config.grad_accumulation
        for name, value in parts.items():  # each modality's loss, where the run trains more than one
            part_losses[name] = part_losses.get(name, 0.0) + value * weight / replicas.world / config.grad_accumulation
        seen += len(batch)
    total_loss = replicas.total(total_loss)  # the global batch's mean, the same on every rank
    part_losses = sound.reported({name: replicas.total(value) for name, value in part_losses.items()})
    if not math.isfinite(total_loss):
        raise NonFiniteLoss(step, total_loss, output_dir)  # before the optimizer touches the LoRA
    run.scaler.unscale_(run.optimizer)  # clip and report the true gradient, not the scaled one
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, config.max_grad_norm))
    run.scaler.step(run.optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
    run.scaler.update()
    if run.ema is not None:
        run.ema.update()
    run.schedule.step()
    run.optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    return {
        "type": "progress", "step": step, "steps": plan.steps, "loss": total_loss, **part_losses,
        "lr": run.schedule.get_last_lr()[0], "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "samples_per_s": seen / elapsed,
        "peak_memory_gb": _peak_memory_gb(plan.device),
        "loss_scale": run.scaler.get_scale() if run.scaler.is_enabled() else None,
    }


def _loss(plan: TrainingPlan, run: _Run, noisy: torch.Tensor, timesteps: torch.Tensor, target: torch.Tensor,
          cond: dict[str, torch.Tensor], images: list[int], draws: list[torch.Generator],
          ) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss, and each modality's where a clip's sound trains beside its picture."""
    weighting, kind = str(run.chosen.loss_weighting.value), plan.objective.prediction
    if run.sound is not None:
        return sound.step_loss(run, run.sound, (noisy, timesteps, target), cond, images, draws, (weighting, kind))
    prediction = run.runtime.predict(run.pipe, run.forward, noisy, timesteps, cond)
    return levers.weighted_mse(prediction, target, weighting, kind, timesteps, run.noise_schedule), {}


def _finish(
    plan: TrainingPlan, run: _Run, step: int, stop: str | None, output_dir: Path, registry: Registry,
    replicas: Replicas,
) -> dict[str, object]:
    """The terminal event: the LoRA (and its EMA) saved on rank 0, unless the stop discards it."""
    if stop in ("discard", "cancel"):
        return {"type": "stopped" if stop == "discard" else "cancelled", "step": step, "outputs": {}}
    pipe, denoiser = run.pipe, run.denoiser
    ranks = replicas.in_sync({n: p for n, p in denoiser.named_parameters() if p.requires_grad})
    if not replicas.main:
        return {"type": "stopped" if stop == "save" else "completed", "step": step, "outputs": {}}
    outputs = save_lora(plan, pipe, denoiser, output_dir, registry=registry)
    if run.ema is not None:
        with run.ema.swapped():
            outputs["lora_ema"] = str(levers.save_ema(output_dir, lambda folder: save_lora(
                plan, pipe, denoiser, folder, registry=registry)))
    return {"type": "stopped" if stop == "save" else "completed", "step": step, "outputs": outputs, **ranks}


class NonFiniteLoss(EngineError):
    """The loss became NaN or infinite: the run stops before that step touches the LoRA."""

    code = "non_finite_loss"

    def __init__(self, step: int, value: float, output_dir: Path) -> None:
        from engine.training.checkpoints import latest_checkpoint

        kept = latest_checkpoint(output_dir)
        super().__init__(
            f"the loss became {value} at step {step}; the run was stopped before that step changed the LoRA. "
            + (f"The last good checkpoint is {kept} (train --resume continues from it). " if kept else "")
            + "Try a lower --lr, or --mixed-precision bf16 (or no) instead of fp16"
        )


def _grad_scaler(plan: TrainingPlan) -> torch.amp.GradScaler:
    """Loss scaling for fp16: without it small fp16 gradients flush to zero and large ones
    overflow, and the LoRA silently turns NaN (a black image). Off (a no-op) otherwise."""
    fp16 = plan.weight_dtype.value == "fp16" or plan.config.mixed_precision == "fp16"
    return torch.amp.GradScaler(plan.device, enabled=fp16)


def _add_lora(plan: TrainingPlan, denoiser: torch.nn.Module, registry: Registry) -> str:
    """Add the adapter through the ``engine_lora_add`` hook (default: diffusers'
    peft integration, else peft's generic injection); returns how."""
    from peft import LoraConfig

    config = plan.config
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha or config.lora_rank,
        lora_dropout=config.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=list(plan.lora_targets),
    )
    how = family_hooks.lora_add(registry, plan.family, denoiser, lora)
    for param in denoiser.parameters():
        if param.requires_grad:  # the base was frozen before: only the adapter trains
            param.data = param.data.float()  # the adapter trains in fp32 over any base
    return how


def _trained_module(plan: TrainingPlan, pipe: Any, modules: list[torch.nn.Module]) -> torch.nn.Module:
    """The module the loop trains: the one denoiser, or both experts as one (each row to the
    expert of its timestep, at the pipeline's boundary)."""
    if len(modules) == 1:
        return modules[0]
    from engine.training.experts import ExpertPair

    assert plan.expert is not None
    steps = float(getattr(pipe.scheduler.config, "num_train_timesteps", 1000))
    return ExpertPair(modules[0], modules[1], plan.expert.value.boundary * steps)


def _compiled(plan: TrainingPlan, denoiser: torch.nn.Module) -> torch.nn.Module:
    if plan.compile.value == "regional":
        regions = set(plan.family.speed.compile_regions)
        for module in denoiser.modules():
            if type(module).__name__ in regions:
                module.compile(dynamic=True)
    return denoiser


def _noise(
    plan: TrainingPlan, x0: torch.Tensor, schedule: Any, draws: list[torch.Generator], shift: float | None = None,
    sigma_range: tuple[float, float] = (0.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise and a timestep per example, each from that example's own generator (``draws``).

    Flow matching draws a sigma the family's way, shifts it, and maps it into
    ``sigma_range`` (one expert's range of a two-expert base; the whole schedule otherwise).

    The noise is drawn straight into its rows of one batch tensor (no per-example tensors
    to stack: a video latent's noise is tens of MB an example), the same values a
    per-example draw gives, so a resume and any split over ranks draw what they drew."""
    noise = torch.empty((len(draws), *x0.shape[1:]))
    for row, generator in zip(noise, draws, strict=True):
        torch.randn(row.shape, generator=generator, out=row)
    noise = noise.to(x0.device, x0.dtype)
    if schedule is None:  # flow matching
        if plan.objective.timestep_sampling == "logit_normal":
            sigmas = torch.sigmoid(torch.cat([torch.randn(1, generator=g) for g in draws]))
        else:
            sigmas = torch.cat([torch.rand(1, generator=g) for g in draws])
        low, high = sigma_range
        sigmas = levers.shift_sigmas(sigmas, shift)
        if (low, high) != (0.0, 1.0):
            sigmas = low + (high - low) * sigmas
        sigmas = sigmas.to(x0.device)
        s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        return (1 - s) * x0 + s * noise, sigmas, noise - x0
    steps = int(schedule.config.num_train_timesteps)
    timesteps = torch.cat([torch.randint(0, steps, (1,), generator=g) for g in draws]).to(x0.device)
    noisy = schedule.add_noise(x0, noise, timesteps)
    if schedule.config.prediction_type == "v_prediction":
        return noisy, timesteps, schedule.get_velocity(x0, noise, timesteps)
    return noisy, timesteps, noise


def _peak_memory_gb(device: str) -> float | None:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return None
