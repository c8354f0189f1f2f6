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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from PIL import Image, ImageOps

from engine.errors import EngineError
from engine.contract.family_runtime import load_runtime
from engine.runtime import flags
from engine.training.precision import check_this_machine, pinned_sdpa, place_base, rms_norm_patch
from engine.training.buckets import Fit, epoch_batches, fit
from engine.training.captions import CaptionOptions, choose, prompt_table
from engine.contract.plugins import Registry, load_registry
from engine.training import levers
from engine.training.preflight import TrainingPlan
from engine.training.export import save_lora
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
    config = plan.config
    device = torch.device(plan.device)
    dtype = TORCH_DTYPES[plan.weight_dtype.value]
    runtime = load_runtime(plan.family, flow_matching=plan.objective.prediction == "flow_matching")
    torch.manual_seed(config.seed)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    emit({"type": "phase", "phase": "loading", "message": f"loading {plan.base.location}"})
    pipe = _load_pipeline(plan, dtype)
    _check_stop(should_stop)
    denoiser: torch.nn.Module = getattr(pipe, plan.family.denoiser)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False)
    emit({"type": "phase", "phase": "caching", "message": "encoding images and captions",
          "dataset": plan.dataset.to_dict(), "buckets": plan.buckets.to_dict() if plan.buckets else None})
    latents, conditioning, captions = _cache_inputs(plan, pipe, runtime, device, dtype, should_stop)
    groups = plan.buckets.groups() if plan.buckets else [list(range(len(latents)))]
    options = CaptionOptions.from_config(config)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != plan.family.denoiser:
            component.to("cpu")  # the encoders are done: give their memory back
    added = _add_lora(plan, denoiser, registry)  # on the host: the base is converted after the adapter is in
    placement = place_base(denoiser, plan.base_precision.value, plan.device)
    if placement is not None:
        emit({"type": "phase", "phase": "placing", "message": placement.path})
    quantised = placement.layers if placement is not None else 0
    params = [p for p in denoiser.parameters() if p.requires_grad]  # as placed on the device
    if plan.gradient_checkpointing.value and hasattr(denoiser, "enable_gradient_checkpointing"):
        denoiser.enable_gradient_checkpointing()
    forward = replicas.prepare(_compiled(plan, denoiser))  # DDP under accelerate: gradients sync in backward
    denoiser.train()
    chosen = levers.of(plan)
    optimizer = levers.build_optimizer(str(chosen.optimizer.value), params, float(chosen.learning_rate.value))
    ema = levers.LoraEma(params, chosen.ema.value) if chosen.ema.value is not None else None
    from diffusers.optimization import get_scheduler

    schedule = get_scheduler(
        chosen.lr_scheduler.value, optimizer,
        num_warmup_steps=int(chosen.warmup_steps.value), num_training_steps=plan.steps,
    )
    noise_schedule = runtime.training_scheduler(pipe) if plan.objective.prediction != "flow_matching" else None
    generator = torch.Generator().manual_seed(config.seed)
    emit({"type": "started", "steps": plan.steps, "lora_adapter": added, "trainable_params": sum(p.numel() for p in params),
          "quantised_layers": quantised,
          "base_placement": placement.to_dict() if placement is not None else None})
    scaler = _grad_scaler(plan)
    order: list[list[int]] = []  # batches still to come this epoch, each within one bucket
    step = 0
    if config.resume_from is not None:
        step, order = _resume(Path(config.resume_from), denoiser, optimizer, schedule, generator, scaler, ema)
        emit({"type": "phase", "phase": "training", "message": f"resumed from step {step}"})
    _check_stop(should_stop)
    stop: str | None = None
    for step in range(step + 1, plan.steps + 1):
        started = time.perf_counter()
        total_loss, seen, per_step = 0.0, 0, config.batch_size * replicas.world  # the global batch
        for micro in range(config.grad_accumulation):
            if not order:
                order = epoch_batches(groups, per_step, lambda n: torch.randperm(n, generator=generator).tolist())
            batch, order = order[0], order[1:]
            shard, weight = replicas.shard(batch, config.batch_size)  # this rank's (slot, image) pairs
            slots = [micro * per_step + slot for slot, _ in shard]
            x0 = torch.stack([latents[image] for _, image in shard]).to(device, dtype)
            rows = [_prompt_row(captions, options, config.seed, step, slot, image)
                    for slot, (_, image) in zip(slots, shard)]
            cond = {k: v[rows].to(device) for k, v in conditioning.items()}
            draws = example_generators(config.seed, step, slots)
            noisy, timesteps, target = _noise(plan, x0, noise_schedule, draws, chosen.flow_shift.value)
            with replicas.no_sync(forward, last=micro == config.grad_accumulation - 1):
                prediction = runtime.predict(pipe, forward, noisy, timesteps, cond)
                loss = levers.weighted_mse(prediction, target, str(chosen.loss_weighting.value),
                                           plan.objective.prediction, timesteps, noise_schedule) * weight
                replicas.backward(scaler.scale(loss / config.grad_accumulation))
            total_loss += loss.item() / replicas.world / config.grad_accumulation
            seen += len(batch)
        total_loss = replicas.total(total_loss)  # the global batch's mean, the same on every rank
        if not math.isfinite(total_loss):
            raise NonFiniteLoss(step, total_loss, output_dir)  # before the optimizer touches the LoRA
        scaler.unscale_(optimizer)  # clip and report the true gradient, not the scaled one
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        scaler.step(optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
        scaler.update()
        if ema is not None:
            ema.update()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        emit({
            "type": "progress", "step": step, "steps": plan.steps, "loss": total_loss,
            "lr": schedule.get_last_lr()[0], "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "samples_per_s": seen / elapsed,
            "peak_memory_gb": _peak_memory_gb(plan.device),
            "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        })
        stop = should_stop()
        if replicas.main and config.save_every and (step % config.save_every == 0 or stop == "save"):
            path = _checkpoint(plan, pipe, denoiser, output_dir, step, optimizer, schedule, generator, order, scaler,
                               registry, ema)
            emit({"type": "checkpoint", "step": step, "path": str(path)})
        if replicas.main and config.sample_every and step % config.sample_every == 0:
            from engine.training.samples import write_samples

            emit({"type": "samples", "step": step, "samples": write_samples(plan, pipe, denoiser, output_dir, step)})
        if stop is not None:
            break
    if stop in ("discard", "cancel"):
        return {"type": "stopped" if stop == "discard" else "cancelled", "step": step, "outputs": {}}
    ranks = replicas.in_sync({n: p for n, p in denoiser.named_parameters() if p.requires_grad})
    if not replicas.main:
        return {"type": "stopped" if stop == "save" else "completed", "step": step, "outputs": {}}
    outputs = save_lora(plan, pipe, denoiser, output_dir, registry=registry)
    if ema is not None:
        with ema.swapped():
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


def _checkpoint(
    plan: TrainingPlan, pipe: Any, denoiser: torch.nn.Module, output_dir: Path, step: int,
    optimizer: torch.optim.Optimizer, schedule: Any, generator: torch.Generator, order: list[list[int]],
    scaler: torch.amp.GradScaler, registry: Registry, ema: levers.LoraEma | None = None,
) -> Path:
    """Everything the next step depends on, so a resumed run continues bit for bit."""
    from engine.training.checkpoints import save_checkpoint

    state = {
        "trainable": {n: p.detach().to("cpu").clone() for n, p in denoiser.named_parameters() if p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "scheduler": schedule.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if plan.device == "cuda" else None,
        "generator": generator.get_state(),
        "order": [list(batch) for batch in order],
        "scaler": scaler.state_dict(),
        "ema": ema.state_dict() if ema is not None else None,  # the average continues on resume
    }
    return save_checkpoint(
        output_dir, step, state, lambda folder: save_lora(plan, pipe, denoiser, folder, registry=registry),
        plan.config.keep_checkpoints
    )


def _resume(
    path: Path, denoiser: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: Any,
    generator: torch.Generator, scaler: torch.amp.GradScaler, ema: levers.LoraEma | None = None,
) -> tuple[int, list[list[int]]]:
    """Load a checkpoint over the freshly built run; the step it was taken at and the batch order."""
    from engine.training.checkpoints import load_checkpoint

    state = load_checkpoint(path)
    trainable = state["trainable"]
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if param.requires_grad:
                param.copy_(trainable[name].to(param.device, param.dtype))
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    generator.set_state(state["generator"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema is not None:
        _resume_ema(ema, state.get("ema"), path)
    # Batches (lists); a checkpoint from before aspect buckets holds image indices: one per batch.
    return int(state["step"]), [list(b) if isinstance(b, (list, tuple)) else [int(b)] for b in state["order"]]


def _resume_ema(ema: levers.LoraEma, saved: dict[str, Any] | None, path: Path) -> None:
    """Continue the checkpoint's EMA; a checkpoint without one (the run had no EMA,
    or predates it) starts the average from the restored weights."""
    if saved is None:
        ema.shadow = [p.detach().float().clone() for p in ema.params]
        return
    try:
        ema.load_state_dict(saved)
    except ValueError as exc:
        raise EngineError(f"cannot resume the EMA from {path}: {exc}", code="resume_mismatch") from None


def _load_pipeline(plan: TrainingPlan, dtype: torch.dtype) -> Any:
    import diffusers

    components: dict[str, Any] = {}
    if plan.base_precision.value == "nf4":
        from engine.runtime.quantize import nf4_config

        config = diffusers.DiffusionPipeline.load_config(plan.base.location)
        denoiser_cls = getattr(diffusers, config[plan.family.denoiser][1])
        components[plan.family.denoiser] = denoiser_cls.from_pretrained(
            plan.base.location, subfolder=plan.family.denoiser, dtype=dtype,
            quantization_config=nf4_config(dtype),
        )
    pipe = diffusers.DiffusionPipeline.from_pretrained(plan.base.location, dtype=dtype, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclass(frozen=True)
class _Captions:
    """The cached prompts' rows: each image's caption variants and the empty prompt's (caption dropout)."""

    per_image: list[list[int]]
    empty: int | None


def _prompt_row(captions: _Captions, options: CaptionOptions, seed: int, step: int, slot: int, image: int) -> int:
    """The cached prompt row sample ``slot`` of ``step`` trains on (a pure draw: resume repeats it)."""
    variants = captions.per_image[image]
    pick = choose(options, seed, step, slot, len(variants))
    if pick is None and captions.empty is not None:
        return captions.empty
    return variants[pick or 0]


def _cache_inputs(
    plan: TrainingPlan, pipe: Any, runtime: ModuleType, device: torch.device, dtype: torch.dtype,
    should_stop: StopCheck,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], _Captions]:
    """Latents per image (at its bucket's size) and prompt embeddings per distinct prompt, computed once.

    Caption options are met here: the trigger word is in every cached prompt,
    caption dropout adds the empty prompt, and tag shuffling caches a few
    shuffles per caption (:mod:`engine.training.captions`); no text encoder
    runs during training.
    """
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != plan.family.denoiser:
            component.to(device)
    size = plan.config.resolution
    latents = []
    for index, item in enumerate(plan.dataset.items):
        _check_stop(should_stop)
        shape = plan.buckets.fits[index] if plan.buckets else fit(item.size, (size, size))
        pixels = _load_pixels(item.image, shape).to(device, dtype)
        latents.append(runtime.encode_images(pipe, pixels)[0].to("cpu"))
    config = plan.config
    prompts, per_image, empty = prompt_table(
        [item.caption for item in plan.dataset.items], CaptionOptions.from_config(config), config.seed
    )
    conditioning = _cached_prompts(plan, pipe, runtime, prompts, device, dtype)
    return latents, conditioning, _Captions(per_image, empty)


def _cached_prompts(
    plan: TrainingPlan, pipe: Any, runtime: ModuleType, prompts: list[str], device: torch.device, dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The prompts' embeddings, from the on-disk cache when this base encoded these
    exact prompts before (see :mod:`engine.runtime.prompt_cache`)."""
    config = plan.config

    def encode(texts: list[str]) -> dict[str, torch.Tensor]:
        return {k: v.to("cpu") for k, v in runtime.encode_prompts(pipe, texts, device, dtype).items()}

    if not config.prompt_cache:
        return encode(prompts)
    from engine.runtime.prompt_cache import PromptCache, default_dir, encoder_identity, one_row_per_prompt

    cache = PromptCache(Path(config.prompt_cache_dir) if config.prompt_cache_dir else default_dir())
    settings = {"dtype": str(dtype), "device": device.type, "encode": f"{runtime.__name__}.encode_prompts", "family": plan.family.name}
    embeddings, _ = cache.get_or_encode(encoder_identity(plan.base.location), prompts, settings, encode,
                                        fits=one_row_per_prompt(len(prompts)))
    return embeddings


def _load_pixels(path: Path, shape: Fit) -> torch.Tensor:
    """Upright RGB resized to cover ``shape.bucket`` and centre-cropped to it, in [-1, 1], [1, 3, H, W]."""
    with Image.open(path) as image:
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    if rgb.size != shape.source:
        shape = fit(rgb.size, shape.bucket)  # the file changed since the preflight: fit what is there
    rgb = rgb.resize(shape.resized, Image.Resampling.BICUBIC).crop(shape.box)
    width, height = shape.bucket
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return (data.permute(2, 0, 1).float() / 127.5 - 1.0).unsqueeze(0)


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
    how = registry.lora_add(plan.family, denoiser, lora)
    for param in denoiser.parameters():
        if param.requires_grad:  # the base was frozen before: only the adapter trains
            param.data = param.data.float()  # the adapter trains in fp32 over any base
    return how


def _compiled(plan: TrainingPlan, denoiser: torch.nn.Module) -> torch.nn.Module:
    if plan.compile.value == "regional":
        regions = set(plan.family.compile_regions)
        for module in denoiser.modules():
            if type(module).__name__ in regions:
                module.compile(dynamic=True)
    return denoiser


def _noise(
    plan: TrainingPlan, x0: torch.Tensor, schedule: Any, draws: list[torch.Generator], shift: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise and a timestep per example, each from that example's own generator (``draws``)."""
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in draws]).to(x0.device, x0.dtype)
    if schedule is None:  # flow matching
        if plan.objective.timestep_sampling == "logit_normal":
            sigmas = torch.sigmoid(torch.cat([torch.randn(1, generator=g) for g in draws]))
        else:
            sigmas = torch.cat([torch.rand(1, generator=g) for g in draws])
        sigmas = levers.shift_sigmas(sigmas, shift).to(x0.device)
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
