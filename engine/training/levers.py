"""The trainer's levers, each resolved with its reason before a run starts.

Learning rate and warmup (the family's defaults where the config leaves
them), flow shift (the family's, or by resolution where its scheduler
shifts by resolution), loss weighting (none / min-SNR / bell), a LoRA EMA
exported as a second adapter, and the optimizer (AdamW, 8-bit AdamW where
bitsandbytes and CUDA are present, Adafactor). Resolution is pure (the
preflight runs it); the torch helpers the loop calls import torch lazily.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.references import EMA_FILE
from engine.contract.types import FamilySpec, LatentGeometry, TrainingDefaults, TrainingObjective

#: The engine's defaults where neither the config nor the family says.
ENGINE_LEARNING_RATE = 1e-4
ENGINE_WARMUP_STEPS = 0
#: min-SNR's gamma (Hang et al. 2023: 5 works across resolutions).
MIN_SNR_GAMMA = 5.0
#: The bell weighting: a Gaussian over sigma (or t/T) centred mid-schedule.
BELL_CENTRE, BELL_WIDTH = 0.5, 0.25


@dataclass(frozen=True)
class TrainingLevers:
    learning_rate: Resolved[float]
    warmup_steps: Resolved[int]
    lr_scheduler: Resolved[str]
    #: The sigma shift of flow-matching sampling; None for epsilon / v prediction.
    flow_shift: Resolved[float | None]
    loss_weighting: Resolved[str]
    #: The EMA decay; None: no EMA.
    ema: Resolved[float | None]
    optimizer: Resolved[str]

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name).to_dict() for name in self.__dataclass_fields__}


#: A default warmup is at most 1/WARMUP_SHARE of the run's steps.
WARMUP_SHARE = 10


def resolve_levers(
    family: FamilySpec, objective: TrainingObjective, config: Any, device: str, hardware: HardwareProfile,
    *, steps: int | None = None,
) -> TrainingLevers:
    """Every lever for ``config`` (a :class:`TrainingConfig`), or the first refusal.

    :raises PreflightError: a lever that cannot run here (8-bit AdamW without
        CUDA, a flow shift on a family that does not flow-match).
    """
    defaults = family.training.defaults or TrainingDefaults()
    learning_rate = _defaulted(config.learning_rate, defaults.learning_rate, ENGINE_LEARNING_RATE, family, "LR")
    warmup = _defaulted(config.warmup_steps, defaults.warmup_steps, ENGINE_WARMUP_STEPS, family, "warmup")
    if warmup.source == "auto" and steps is not None and warmup.value > steps // WARMUP_SHARE:
        # A default warmup never takes more than a tenth of the run: a short run would
        # otherwise end before its learning rate arrives (2 steps of a 10-step warmup).
        warmup = auto(steps // WARMUP_SHARE, f"{warmup.reason}, capped at a tenth of the run's {steps} steps")
    scheduler: Resolved[str] = explicit(config.lr_scheduler, "as configured")
    if warmup.value and config.lr_scheduler == "constant":
        scheduler = auto(
            "constant_with_warmup", f"{warmup.value} warmup steps: the constant schedule ramps up first"
        )
    return TrainingLevers(
        learning_rate=learning_rate,
        warmup_steps=warmup,
        lr_scheduler=scheduler,
        flow_shift=resolve_flow_shift(family, objective, config.flow_shift, config.resolution),
        loss_weighting=_loss_weighting(config.loss_weighting, objective),
        ema=(explicit(config.ema_decay, f"an EMA of the LoRA (decay {config.ema_decay}) is saved as {EMA_FILE}")
             if config.ema_decay is not None else explicit(None, "no EMA")),
        optimizer=_optimizer(config.optimizer, device, hardware),
    )


def _defaulted(
    value: float | int | None, family_value: float | int | None, engine_value: float | int,
    family: FamilySpec, what: str,
) -> Resolved[Any]:
    if value is not None:
        return explicit(value, "as configured")
    if family_value is not None:
        source = (family.training.defaults.source if family.training.defaults else "") or "its table"
        return auto(family_value, f"{family.label}'s default {what} ({source})")
    return auto(engine_value, f"the engine's default {what}")


def resolve_flow_shift(
    family: FamilySpec, objective: TrainingObjective, requested: float | str | None, resolution: int
) -> Resolved[float | None]:
    """The sigma shift: a number as asked, ``auto`` by resolution, None: the family's."""
    if objective.prediction != "flow_matching":
        if requested is not None:
            raise PreflightError(
                f"flow_shift applies to flow-matching families; {family.label} trains by "
                f"{objective.prediction.replace('_', ' ')}. Leave flow_shift unset",
                code="not_applicable",
            )
        return auto(None, f"{family.label} trains by {objective.prediction.replace('_', ' ')}: no flow shift")
    defaults = family.training.defaults or TrainingDefaults()
    if isinstance(requested, (int, float)):
        return explicit(float(requested), "as configured")
    if requested == "auto" or (requested is None and defaults.flow_shift_auto):
        shift = resolution_shift(defaults, resolution, family.rendering.geometry)
        source = auto if requested is None else explicit
        return source(round(shift, 4), (
            f"by resolution as {family.label}'s scheduler shifts: {resolution} px is "
            f"{family.rendering.geometry.image_tokens(resolution)} image tokens, mu {math.log(shift):.3f} "
            f"({defaults.base_shift} at {defaults.base_seq_len} to {defaults.max_shift} at {defaults.max_seq_len})"
        ))
    return auto(defaults.flow_shift, f"{family.label}'s default shift" + (f" ({defaults.source})" if defaults.source else ""))


def resolution_shift(defaults: TrainingDefaults, resolution: int, geometry: LatentGeometry = LatentGeometry()) -> float:
    """exp(mu), mu interpolated linearly in image tokens (the schedulers' dynamic shift)."""
    span = max(1, defaults.max_seq_len - defaults.base_seq_len)
    slope = (defaults.max_shift - defaults.base_shift) / span
    mu = defaults.base_shift + slope * (geometry.image_tokens(resolution) - defaults.base_seq_len)
    return math.exp(mu)


def _loss_weighting(requested: str, objective: TrainingObjective) -> Resolved[str]:
    if requested == "none":
        return explicit("none", "every timestep weighs the same")
    if requested == "min_snr":
        return explicit("min_snr", f"min-SNR (gamma {MIN_SNR_GAMMA:g}): low-noise steps, which dominate the "
                        "loss yet teach little, are weighed down")
    return explicit("bell", f"a bell over the schedule (centre {BELL_CENTRE}, width {BELL_WIDTH}): "
                    "mid-noise steps, where composition is learnt, weigh most")


def _optimizer(requested: str, device: str, hardware: HardwareProfile) -> Resolved[str]:
    if requested == "adamw8bit":
        if device != "cuda":
            raise PreflightError(
                "optimizer adamw8bit (bitsandbytes 8-bit AdamW) needs a CUDA GPU; this run is on the "
                f"{device}. Use optimizer adamw or adafactor",
                code="optimizer_unavailable",
            )
        if not hardware.bitsandbytes_usable:
            raise PreflightError(
                "optimizer adamw8bit needs bitsandbytes, which is not usable here "
                "(pip install 'diffusion-engine[nf4]'); use adamw or adafactor",
                code="optimizer_unavailable",
            )
        return explicit("adamw8bit", "bitsandbytes 8-bit AdamW: optimizer states at a quarter of fp32's")
    if requested == "adafactor":
        return explicit("adafactor", "Adafactor (factored second moments, fixed LR): the least optimizer memory")
    return explicit("adamw", "AdamW (torch's fused kernel where the device has it)")


# -- torch helpers the loop calls ---------------------------------------------------------


def of(plan: Any) -> TrainingLevers:
    """The plan's levers (resolved now for a plan built without them)."""
    if plan.levers is not None:
        return plan.levers
    return resolve_levers(plan.family, plan.objective, plan.config, plan.device, plan.hardware, steps=plan.steps)


def weighted_mse(
    prediction: Any, target: Any, kind: str, prediction_type: str, timesteps: Any, schedule: Any = None
) -> Any:
    """The batch's MSE with each sample weighted by the loss weighting."""
    import torch

    if kind == "none":
        return torch.nn.functional.mse_loss(prediction.float(), target.float())
    per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
    if schedule is None:  # flow matching: the timesteps are the sigmas
        weights = loss_weights(kind, timesteps.float(), prediction_type)
    else:
        alphas = schedule.alphas_cumprod.to(timesteps.device)[timesteps]
        level = timesteps.float() / float(schedule.config.num_train_timesteps)
        weights = loss_weights(kind, level, prediction_type, snr=alphas / (1 - alphas))
    return (weights.to(per_sample.device) * per_sample).mean()


def save_ema(output_dir: Any, save: Any) -> Any:
    """Save the (swapped-in) EMA weights with the trainer's own saver, as :data:`EMA_FILE`."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(dir=output_dir, prefix=".ema-"))
    try:
        written = Path(save(folder)["lora"])
        target = Path(output_dir) / EMA_FILE
        written.replace(target)
        return target
    finally:
        shutil.rmtree(folder, ignore_errors=True)



def shift_sigmas(sigmas: Any, shift: float | None) -> Any:
    """``shift * s / (1 + (shift - 1) * s)``: more of the samples at high noise for shift > 1."""
    if shift is None or shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def loss_weights(kind: str, noise_level: Any, prediction: str, snr: Any = None) -> Any:
    """Per-sample loss weights. ``noise_level``: sigma for flow matching, t / T
    otherwise, in [0, 1]; ``snr``: the DDPM schedule's SNR where known."""
    import torch

    if kind == "none":
        return torch.ones_like(noise_level)
    if kind == "bell":
        # Normalised so the weight averages 1 over a uniform noise level.
        norm = BELL_WIDTH * math.sqrt(2 * math.pi) * math.erf(BELL_CENTRE / (BELL_WIDTH * math.sqrt(2)))
        return torch.exp(-((noise_level - BELL_CENTRE) ** 2) / (2 * BELL_WIDTH**2)) / norm
    if snr is None:  # flow matching: x_t = (1 - s) x0 + s noise
        level = noise_level.clamp(1e-4, 1 - 1e-4)
        snr = ((1 - level) / level) ** 2
    clipped = snr.clamp(max=MIN_SNR_GAMMA)
    if prediction == "v_prediction":
        return clipped / (snr + 1)
    # Epsilon, and flow matching's velocity target (noise - x0), which like
    # epsilon stays well scaled at high noise: cap the low-noise steps at gamma.
    return clipped / snr


def build_optimizer(kind: str, params: list[Any], lr: float) -> Any:
    """The optimizer the levers chose, over ``params``."""
    import torch

    if kind == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=lr)
    if kind == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    return torch.optim.AdamW(params, lr=lr, **adamw_kernel(params))


#: Devices whose torch has the fused AdamW kernel (one kernel over every tensor).
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})


def adamw_kernel(params: list[Any]) -> dict[str, bool]:
    """``fused=True`` where every parameter sits on a device with torch's fused AdamW and is
    a float: one kernel over all tensors instead of torch's default per-parameter loop on the
    CPU (measured on 400 LoRA-shaped tensors, 2-core CPU: 106-111 ms a step against 200-226;
    ``foreach`` was slower still there, 477-515). Empty (torch's default) elsewhere."""
    if params and all(p.device.type in FUSED_ADAMW_DEVICES and p.dtype.is_floating_point for p in params):
        return {"fused": True}
    return {}


class LoraEma:
    """An fp32 exponential moving average of the trainable (LoRA) parameters."""

    def __init__(self, params: list[Any], decay: float) -> None:
        self.decay = decay
        self.params = params
        self.shadow = [p.detach().float().clone() for p in params]

    def update(self) -> None:
        import torch

        with torch.no_grad():
            for shadow, param in zip(self.shadow, self.params):
                shadow.lerp_(param.detach().float(), 1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        """The shadow weights and decay, for a checkpoint (so a resumed run continues the average)."""
        return {"decay": self.decay, "shadow": [s.detach().to("cpu").clone() for s in self.shadow]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the average a checkpoint saved.

        :raises ValueError: the checkpoint's EMA covers other parameters (a
            different rank or target set), so it cannot continue this one.
        """
        import torch

        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError(
                f"the checkpoint's LoRA EMA holds {len(shadow)} tensors, this run trains {len(self.shadow)} "
                "of other shapes; resume with the run's own lora_rank and targets"
            )
        self.shadow = [s.to(device=p.device, dtype=torch.float32) for s, p in zip(shadow, self.params)]

    def swapped(self) -> Any:
        """A context in which the parameters hold the EMA (restored on exit)."""
        import contextlib

        import torch

        @contextlib.contextmanager
        def swap() -> Any:
            saved = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for param, shadow in zip(self.params, self.shadow):
                    param.copy_(shadow.to(param.dtype))
            try:
                yield
            finally:
                with torch.no_grad():
                    for param, kept in zip(self.params, saved):
                        param.copy_(kept)

        return swap()

