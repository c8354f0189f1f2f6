"""The family runtime module's contract: the functions the engine calls, declared.

A family names one torch module (``FamilySpec.runtime_module``). The generic
LoRA trainer calls :class:`FamilyRuntime`'s three functions on it; an
epsilon / v-prediction family adds ``training_scheduler``; the optional
functions opt into features (the on-disk prompt cache, the training-memory
tool). :func:`runtime_problems` checks a module against this: the functions
exist and take the arguments the engine passes. The contract kit runs it,
and :func:`load_runtime` (what the engine imports runtime modules through)
refuses a module that breaks it with one clear error, before a run starts.

Torch-free: a module is checked by its functions' signatures.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from engine.errors import PluginError


@runtime_checkable
class FamilyRuntime(Protocol):
    """What the generic trainer calls (``pipe``: the loaded diffusers pipeline)."""

    def encode_prompts(self, pipe: Any, prompts: list[str], device: Any, dtype: Any) -> Mapping[str, Any]:
        """The conditioning ``predict`` takes, for a batch of captions (no grad)."""

    def encode_images(self, pipe: Any, pixels: Any) -> Any:
        """Latents [B, C, h, w] for pixels [B, 3, H, W] in [-1, 1], as the pipeline's VAE makes them."""

    def predict(self, pipe: Any, denoiser: Any, noisy_latents: Any, timesteps: Any,
                conditioning: Mapping[str, Any]) -> Any:
        """The denoiser's prediction (calls ``denoiser``, the trainer's peft-wrapped module)."""


class SoundRuntime(Protocol):
    """What a family that trains a clip's sound (``TrainingSpec.sound``) adds to :class:`FamilyRuntime`."""

    def encode_sound(self, pipe: Any, samples: Any) -> Any:
        """One track's normalised latents (no batch axis) for ``samples`` [channels, n] in [-1, 1] at the
        family's ``VideoSpec.audio_rate``, as the pipeline's audio VAE makes them."""

    def predict_with_sound(self, pipe: Any, denoiser: Any, noisy_latents: Any, noisy_sound: Any, timesteps: Any,
                           sound_timesteps: Any, conditioning: Mapping[str, Any]) -> tuple[Any, Any]:
        """Both velocities (``noise - x0``, the picture's and the sound's) for a batch noised at sigmas
        ``timesteps`` (picture) and ``sound_timesteps`` (sound)."""


#: Function -> its parameters, for the functions every trainable family defines.
REQUIRED: Mapping[str, tuple[str, ...]] = {
    "encode_prompts": ("pipe", "prompts", "device", "dtype"),
    "encode_images": ("pipe", "pixels"),
    "predict": ("pipe", "denoiser", "noisy_latents", "timesteps", "conditioning"),
}
#: Needed where the objective is not flow matching: the DDPM schedule timesteps are drawn on.
NON_FLOW: Mapping[str, tuple[str, ...]] = {"training_scheduler": ("pipe",)}
#: Optional, each opting into a feature; the prompt-cache pair comes together.
OPTIONAL: Mapping[str, tuple[str, ...]] = {
    "prompt_inputs": ("pipe", "kwargs"),
    "encode_prompt_inputs": ("pipe", "inputs", "device"),
    "probe_conditioning": ("config", "text_tokens", "dtype"),
    "probe_pipeline": ("model",),
    # A clip's sound trained beside its picture (TrainingSpec.sound): its latents, and both velocities.
    "encode_sound": ("pipe", "samples"),
    "predict_with_sound": ("pipe", "denoiser", "noisy_latents", "noisy_sound", "timesteps", "sound_timesteps",
                           "conditioning"),
}
PAIRS: tuple[tuple[str, str], ...] = (("prompt_inputs", "encode_prompt_inputs"), ("encode_sound", "predict_with_sound"))


def _takes(function: Any, arguments: tuple[str, ...]) -> bool:
    try:
        inspect.signature(function).bind(*arguments)
    except (TypeError, ValueError):
        return False
    return True


def runtime_problems(module: ModuleType | Any, *, flow_matching: bool = True) -> list[str]:
    """What ``module`` lacks or takes wrongly, one sentence each ([] when it keeps the contract)."""
    problems = []
    wanted = {**REQUIRED, **({} if flow_matching else NON_FLOW)}
    for name, arguments in {**wanted, **OPTIONAL}.items():
        function = getattr(module, name, None)
        if function is None:
            if name in wanted:
                problems.append(f"it has no {name}({', '.join(arguments)})")
            continue
        if not callable(function) or not _takes(function, arguments):
            problems.append(f"its {name} does not take ({', '.join(arguments)}) positionally")
    for first, second in PAIRS:
        if hasattr(module, first) != hasattr(module, second):
            have, lack = (first, second) if hasattr(module, first) else (second, first)
            problems.append(f"it has {have} but not {lack} (the {_FEATURES[first]} needs both)")
    return problems


_FEATURES = {"prompt_inputs": "prompt cache", "encode_sound": "sound training"}


def load_runtime(family: Any, *, flow_matching: bool | None = None) -> ModuleType:
    """``family``'s runtime module, imported and checked against the contract.

    :raises PluginError: the module is missing or breaks the contract, naming each problem.
    """
    name = family.runtime_module
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise PluginError(f"{family.name}'s runtime module {name!r} cannot be imported ({exc})",
                          code="plugin_error") from None
    if flow_matching is None:
        objective = family.training.objective
        flow_matching = objective is None or objective.prediction == "flow_matching"
    problems = runtime_problems(module, flow_matching=flow_matching)
    training = getattr(family, "training", None)
    if getattr(training, "sound", None) is not None and not hasattr(module, "encode_sound"):
        problems.append("its table trains sound (TrainingSpec.sound) but it has no encode_sound(pipe, samples) "
                        "and predict_with_sound(...)")
    if problems:
        raise PluginError(
            f"{family.name}'s runtime module {name} breaks the FamilyRuntime contract "
            f"(engine.contract.family_runtime; docs/plugins.md, 'The family runtime module'): {'; '.join(problems)}",
            code="plugin_error",
        )
    return module


__all__ = ["FamilyRuntime", "OPTIONAL", "REQUIRED", "SoundRuntime", "load_runtime", "runtime_problems"]
