"""The one LoRA trainer loop every family plugs into.

The loop is generic: load the base pipeline, cache latents and prompt
embeddings, add a peft LoRA to the denoiser, set up the base precision, and
optimise with AdamW, an LR schedule and gradient clipping (reporting the
pre-clip norm). The family's runtime module (named by its training
objective) supplies ``encode_prompts``, ``encode_images`` and ``predict``;
the objective says how to noise and what to regress: flow matching
(target = noise - x0 at sigma) or epsilon / v prediction on a DDPM schedule.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from PIL import Image, ImageOps

from engine.runtime import flags
from engine.training.precision import apply_base_precision, pinned_sdpa, rms_norm_patch
from engine.training.preflight import TrainingPlan

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"

Emit = Callable[[dict[str, object]], None]
#: Returns None to go on, or "save", "discard" or "cancel".
StopCheck = Callable[[], str | None]


def run_training(plan: TrainingPlan, output_dir: Path, emit: Emit, should_stop: StopCheck) -> dict[str, object]:
    """Train; emit events; return the terminal event (completed / stopped / cancelled)."""
    snapshot = flags.snapshot()
    fused_norm = rms_norm_patch() if plan.device == "cuda" else contextlib.nullcontext()
    try:
        with pinned_sdpa(plan.device), fused_norm:
            return _train(plan, output_dir, emit, should_stop)
    finally:
        snapshot.restore()


def _train(plan: TrainingPlan, output_dir: Path, emit: Emit, should_stop: StopCheck) -> dict[str, object]:
    config = plan.config
    device = torch.device(plan.device)
    dtype = TORCH_DTYPES[plan.weight_dtype.value]
    runtime = importlib.import_module(plan.objective.runtime_module)
    torch.manual_seed(config.seed)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    emit({"type": "phase", "phase": "loading", "message": f"loading {plan.base.location}"})
    pipe = _load_pipeline(plan, dtype)
    denoiser: torch.nn.Module = getattr(pipe, plan.family.denoiser)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False)
    emit({"type": "phase", "phase": "caching", "message": "encoding images and captions"})
    latents, conditioning, caption_index = _cache_inputs(plan, pipe, runtime, device, dtype)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != plan.family.denoiser:
            component.to("cpu")  # the encoders are done: give their memory back
    denoiser.to(device)
    params = _add_lora(plan, denoiser)
    quantised = apply_base_precision(denoiser, plan.base_precision.value)
    if config.gradient_checkpointing and hasattr(denoiser, "enable_gradient_checkpointing"):
        denoiser.enable_gradient_checkpointing()
    forward = _compiled(plan, denoiser)
    denoiser.train()
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate)
    from diffusers.optimization import get_scheduler

    schedule = get_scheduler(
        config.lr_scheduler, optimizer,
        num_warmup_steps=config.warmup_steps, num_training_steps=plan.steps,
    )
    noise_schedule = runtime.training_scheduler(pipe) if plan.objective.prediction != "flow_matching" else None
    generator = torch.Generator().manual_seed(config.seed)
    emit({"type": "started", "steps": plan.steps, "trainable_params": sum(p.numel() for p in params),
          "quantised_layers": quantised})
    order: list[int] = []
    stop: str | None = None
    step = 0
    for step in range(1, plan.steps + 1):
        started = time.perf_counter()
        total_loss = 0.0
        for _ in range(config.grad_accumulation):
            if len(order) < config.batch_size:
                order += torch.randperm(len(latents), generator=generator).tolist()
            batch, order = order[: config.batch_size], order[config.batch_size:]
            x0 = torch.stack([latents[i] for i in batch]).to(device, dtype)
            cond = {k: v[[caption_index[i] for i in batch]].to(device) for k, v in conditioning.items()}
            noisy, timesteps, target = _noise(plan, x0, noise_schedule, generator)
            prediction = runtime.predict(pipe, forward, noisy, timesteps, cond)
            loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
            (loss / config.grad_accumulation).backward()
            total_loss += loss.item() / config.grad_accumulation
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        emit({
            "type": "progress", "step": step, "steps": plan.steps, "loss": total_loss,
            "lr": schedule.get_last_lr()[0], "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "samples_per_s": config.batch_size * config.grad_accumulation / elapsed,
            "peak_memory_gb": _peak_memory_gb(plan.device),
        })
        stop = should_stop()
        if stop is not None:
            break
    if stop in ("discard", "cancel"):
        return {"type": "stopped" if stop == "discard" else "cancelled", "step": step, "outputs": {}}
    outputs = save_lora(plan, pipe, denoiser, output_dir)
    return {"type": "stopped" if stop == "save" else "completed", "step": step, "outputs": outputs}


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


def _cache_inputs(
    plan: TrainingPlan, pipe: Any, runtime: ModuleType, device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """Latents per image and prompt embeddings per distinct caption, computed once."""
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != plan.family.denoiser:
            component.to(device)
    size = plan.config.resolution
    latents = []
    for item in plan.dataset.items:
        pixels = _load_pixels(item.image, size).to(device, dtype)
        latents.append(runtime.encode_images(pipe, pixels)[0].to("cpu"))
    captions = sorted({item.caption for item in plan.dataset.items})
    conditioning = runtime.encode_prompts(pipe, captions, device, dtype)
    conditioning = {k: v.to("cpu") for k, v in conditioning.items()}
    index = [captions.index(item.caption) for item in plan.dataset.items]
    return latents, conditioning, index


def _load_pixels(path: Path, size: int) -> torch.Tensor:
    """Upright RGB, shortest side scaled to ``size``, centre-cropped, in [-1, 1]."""
    with Image.open(path) as image:
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    rgb = ImageOps.fit(rgb, (size, size), Image.Resampling.BICUBIC)
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return (data.permute(2, 0, 1).float() / 127.5 - 1.0).unsqueeze(0)


def _add_lora(plan: TrainingPlan, denoiser: torch.nn.Module) -> list[torch.nn.Parameter]:
    from peft import LoraConfig

    config = plan.config
    denoiser.add_adapter(
        LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha or config.lora_rank,
            lora_dropout=config.lora_dropout,
            init_lora_weights="gaussian",
            target_modules=list(plan.lora_targets),
        )
    )
    params = [p for p in denoiser.parameters() if p.requires_grad]
    for param in params:
        param.data = param.data.float()  # the adapter trains in fp32 over any base
    return params


def _compiled(plan: TrainingPlan, denoiser: torch.nn.Module) -> torch.nn.Module:
    if plan.compile.value == "regional":
        regions = set(plan.family.compile_regions)
        for module in denoiser.modules():
            if type(module).__name__ in regions:
                module.compile(dynamic=True)
    return denoiser


def _noise(
    plan: TrainingPlan, x0: torch.Tensor, schedule: Any, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    noise = torch.randn(x0.shape, generator=generator).to(x0.device, x0.dtype)
    batch = x0.shape[0]
    if schedule is None:  # flow matching
        if plan.objective.timestep_sampling == "logit_normal":
            sigmas = torch.sigmoid(torch.randn(batch, generator=generator))
        else:
            sigmas = torch.rand(batch, generator=generator)
        sigmas = sigmas.to(x0.device)
        s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        return (1 - s) * x0 + s * noise, sigmas, noise - x0
    steps = int(schedule.config.num_train_timesteps)
    timesteps = torch.randint(0, steps, (batch,), generator=generator).to(x0.device)
    noisy = schedule.add_noise(x0, noise, timesteps)
    if schedule.config.prediction_type == "v_prediction":
        return noisy, timesteps, schedule.get_velocity(x0, noise, timesteps)
    return noisy, timesteps, noise


def _peak_memory_gb(device: str) -> float | None:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return None


def save_lora(plan: TrainingPlan, pipe: Any, denoiser: torch.nn.Module, output_dir: Path) -> dict[str, str]:
    """The adapter in diffusers' key format (``transformer.<module>.lora_A.weight``,
    what diffusers' own training scripts write; loads with ``load_lora_weights``)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    output_dir.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(denoiser)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    prefix = plan.family.denoiser
    saver = getattr(type(pipe), "save_lora_weights", None)
    lora_path = output_dir / LORA_WEIGHTS
    if saver is not None:
        saver(str(output_dir), **{f"{prefix}_lora_layers": state}, weight_name=LORA_WEIGHTS)
    else:
        save_file({f"{prefix}.{k}": v for k, v in state.items()}, str(lora_path))
    outputs = {"lora": str(lora_path)}
    if plan.config.export_kohya:
        alpha = plan.config.lora_alpha or plan.config.lora_rank
        outputs["lora_kohya"] = str(_export_kohya(state, float(alpha), output_dir))
    return outputs


def _export_kohya(state: dict[str, torch.Tensor], alpha: float, output_dir: Path) -> Path:
    """The same adapter with kohya key names (``lora_unet_<module>.lora_down``,
    ``.lora_up``, ``.alpha``), the layout kohya's sd-scripts write for
    diffusers module names and ComfyUI reads."""
    from safetensors.torch import save_file

    kohya: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".lora_")
        base = "lora_unet_" + module.replace(".", "_")
        if leaf.startswith("A"):
            kohya[f"{base}.lora_down.weight"] = value
            kohya[f"{base}.alpha"] = torch.tensor(alpha)
        elif leaf.startswith("B"):
            kohya[f"{base}.lora_up.weight"] = value
    path = output_dir / "lora_kohya.safetensors"
    save_file(kohya, str(path))
    return path
