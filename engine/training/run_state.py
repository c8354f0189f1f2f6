"""The trainer's state in a checkpoint: everything the next step depends on
(the LoRA's weights, the optimiser and LR schedule, every RNG, the batch
order, the loss scaler and the EMA), saved so a resumed run continues bit
for bit, and restored over a freshly built run.

The files and their names are :mod:`engine.training.checkpoints`' (torch-free,
so the parent process can list and check them); this module holds the
tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.contract.plugins import Registry
from engine.errors import EngineError
from engine.training import levers
from engine.training.export import save_lora
from engine.training.preflight import TrainingPlan


def save_run_state(
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


def restore_run_state(
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
