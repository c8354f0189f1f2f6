"""Whether a LoRA file fits a model, before anything is applied or evicted.

Each file is converted by the pipeline class's own ``lora_state_dict`` (every
format diffusers knows), and every converted key is matched against the
model's module tree, by name and shape: a file with any key that lands
nowhere is refused with the family it looks like and the count. Before a
load the match runs on a skeleton of the model built on the ``meta`` device
(no weights, no memory); on a loaded pipeline, against its modules.
:mod:`engine.runtime.lora` applies what passed.
"""

from __future__ import annotations

import dataclasses

import importlib
import inspect
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.contract.plugins import Registry
from engine.contract.types import FamilySpec
from engine.preflight.lora import LoraFile, LoraMismatch, mismatch_error
from engine.preflight.source import ModelSource
from engine.runtime.quantize import first_line

_A, _B = ".lora_A.weight", ".lora_B.weight"


# -- conversion and matching ---------------------------------------------------------


def converted_state_dict(
    pipeline_cls: type, file: LoraFile, unet_config: Any = None, *,
    family: FamilySpec | None = None, denoiser: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """``file`` in diffusers' keys (``<component>.<module>...``), converted by
    ``pipeline_cls.lora_state_dict`` exactly as ``load_lora_weights`` does; a kohya file
    of ``family`` with fused modules is split with ``denoiser``'s own widths first
    (:func:`engine.runtime.kohya.diffusers_from_kohya`: diffusers' converter assumes
    the full-size model's), and one whose every module is the denoiser's own by its
    underscored name is read so (a family whose diffusers converter reads no kohya keys)."""
    from safetensors.torch import load_file

    from engine.runtime.kohya import diffusers_from_kohya, is_kohya

    state = load_file(str(file.path))
    if family is not None and denoiser is not None and is_kohya(state):
        linears = {name: int(getattr(getattr(m, "base_layer", m), "out_features"))
                   for name, m in denoiser.named_modules()
                   if hasattr(getattr(m, "base_layer", m), "out_features") and "lora_" not in name}
        split = diffusers_from_kohya(family, state, linears)
        if split is not None:
            return {f"{family.pipeline.denoiser}.{key}": value for key, value in split.items()}
    if not callable(getattr(pipeline_cls, "lora_state_dict", None)):
        return dict(state)  # no diffusers LoRA loader: the engine's own save format, as it is
    kwargs: dict[str, Any] = {}
    if unet_config is not None and "unet_config" in inspect.signature(pipeline_cls.lora_state_dict).parameters:
        kwargs["unet_config"] = unet_config
    try:
        result = pipeline_cls.lora_state_dict(state, **kwargs)
    except (ValueError, KeyError, AssertionError, RuntimeError) as exc:
        raise LoraMismatch(
            f"LoRA {file.path} could not be read as a {pipeline_cls.__name__} LoRA by diffusers "
            f"({first_line(exc)[:300]}); give a LoRA trained for this model"
        ) from None
    return dict(result[0] if isinstance(result, tuple) else result)


def unmatched_modules(
    state: Mapping[str, torch.Tensor], components: Mapping[str, torch.nn.Module]
) -> tuple[list[str], int]:
    """The adapted modules of ``state`` that name no module of ``components``
    or whose shapes differ, and how many modules it adapts in all."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, convert_unet_state_dict_to_peft

    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        component, _, rest = key.partition(".")
        grouped.setdefault(component, {})[rest] = value
    unmatched: list[str] = []
    total = 0
    for component, part in grouped.items():
        model = components.get(component)
        if model is None:
            # whole keys: a bare module (``x_embedder.lora_A.weight``) counts once, by its name
            modules = sorted({_module_of(f"{component}.{k}") for k in part})
            unmatched += modules
            total += len(modules)
            continue
        if not any(_A in k for k in part):
            try:  # the conversions load_lora_weights applies to this component
                if isinstance(model, _transformers_model()):
                    part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
                else:
                    part = convert_unet_state_dict_to_peft(part)
            except ValueError as exc:
                raise LoraMismatch(
                    f"diffusers cannot read this LoRA's {component} keys ({exc}); "
                    "give a LoRA trained for this model"
                ) from None
        if isinstance(model, _transformers_model()) and not hasattr(model, "text_model"):
            part = {k.removeprefix("text_model."): v for k, v in part.items()}
        named = dict(model.named_modules())
        for key, down in part.items():
            if not key.endswith(_A):
                continue
            module = key[: -len(_A)]
            total += 1
            up = part.get(module + _B)
            if not _fits(named.get(module), down, up):
                unmatched.append(f"{component}.{module}")
    return unmatched, total


def _module_of(key: str) -> str:
    for marker in (".lora_A", ".lora_B", ".lora.", "_lora.", ".lora_linear_layer", ".alpha"):
        if marker in key:
            return key.split(marker)[0]
    return key.rpartition(".")[0]


def _fits(module: torch.nn.Module | None, down: torch.Tensor, up: torch.Tensor | None) -> bool:
    if module is None or up is None:
        return False
    base = getattr(module, "base_layer", module)  # already wrapped by peft
    if isinstance(base, torch.nn.Linear) or hasattr(base, "in_features"):
        return down.shape[-1] == base.in_features and up.shape[0] == base.out_features
    if isinstance(base, torch.nn.Conv2d):
        return down.shape[1] == base.in_channels and up.shape[0] == base.out_channels
    return False


def _transformers_model() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


# -- the check before anything is loaded or evicted ------------------------------------


def check_loras(registry: Registry, source: ModelSource, files: Sequence[LoraFile]) -> tuple[LoraFile, ...]:
    """``files`` with their adapted modules counted against ``source``'s model (checked on a
    weightless ``meta`` skeleton of it); refuses (:class:`LoraMismatch`) one with a module the
    model lacks unless it was asked for partially, and one of which nothing matches."""
    if not files:
        return ()
    root = _config_root(source)
    skeleton = _Skeleton(root)
    return _checked(registry, source.family, files, _pipeline_class(root), skeleton.unet_config(), skeleton.get)


def check_on_pipeline(registry: Registry, family: FamilySpec, pipe: Any, files: Sequence[LoraFile]) -> tuple[LoraFile, ...]:
    """The same check against a loaded pipeline's own modules."""
    components = {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
    return _checked(registry, family, files, type(pipe), getattr(components.get("unet"), "config", None), components.get)


def _checked(registry: Registry, family: FamilySpec, files: Sequence[LoraFile], pipeline_cls: type, unet_config: Any,
             component_of: Any) -> tuple[LoraFile, ...]:
    """Each file judged against the components ``component_of(name)`` gives (None: absent)."""
    checked = []
    for file in files:
        if file.adapter_type != "lora":  # LoKr / LoHa: matched module by module
            checked.append(_judged_lycoris(registry, family, file, component_of(file.component or family.pipeline.denoiser)))
            continue
        state = converted_state_dict(pipeline_cls, file, unet_config=unet_config, family=family,
                                     denoiser=component_of(family.pipeline.denoiser))
        state = _onto_component(family, file, state, component_of)
        present = {name: model for name in {k.partition(".")[0] for k in state} if (model := component_of(name)) is not None}
        checked.append(_judged(registry, family, file, *_counted(file, state, present)))
    return tuple(checked)


def _onto_component(
    family: FamilySpec, file: LoraFile, state: dict[str, torch.Tensor], component_of: Any,
) -> dict[str, torch.Tensor]:
    """A second expert's LoRA (its metadata names the component) checked against that component:
    refused where the model has none (a one-expert model), else its keys moved onto it."""
    if file.component is None or file.component == family.pipeline.denoiser:
        return state
    if component_of(file.component) is None:
        raise LoraMismatch(f"LoRA {file.path} is for {file.component}, a second expert this {family.label} model "
                           "does not have (it was trained on a two-expert model); nothing was applied. Give it "
                           "with a two-expert model, or use the run's first LoRA")
    prefix = family.pipeline.denoiser + "."
    return {(file.component + "." + k[len(prefix):]) if k.startswith(prefix) else k: v for k, v in state.items()}


def _judged_lycoris(registry: Registry, family: FamilySpec, file: LoraFile,
                    denoiser: torch.nn.Module | None) -> LoraFile:
    """A LoKr / LoHa file judged as :func:`_judged`: each tensor naming a module the denoiser
    lacks (or a parameter no adapter type has) is an unmatched module."""
    from engine.runtime.lycoris import grouped

    if denoiser is None:
        raise mismatch_error(registry, family, file, [file.component or family.pipeline.denoiser], 1)
    modules, foreign = grouped(file, denoiser)
    return _judged(registry, family, file, foreign, len(modules) + len(foreign))


def _counted(file: LoraFile, state: Mapping[str, torch.Tensor],
             components: Mapping[str, torch.nn.Module]) -> tuple[list[str], int]:
    """The file's unmatched modules and how many it adapts: those its converted ``state`` names
    that the model lacks, and the full-rank differences diffusers' loader drops on the way."""
    unmatched, total = unmatched_modules(state, components)
    dropped = dropped_differences(file, state)
    return unmatched + dropped, total + len(dropped)


#: The names of a full-rank difference's tensors: a module's whole weight, its bias.
DIFFERENCES = (".diff", ".diff_b")


def dropped_differences(file: LoraFile, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The full-rank differences in ``file`` (``<module>.diff`` weights, ``.diff_b`` biases, as
    trainers write them for norms and embeddings) that hold something and that the conversion to
    ``state`` does not make a LoRA of: every norm's (diffusers' converters drop them, saying so
    only in a log line), a ``diff_b`` no converter turned into a LoRA bias, and one left in
    ``state`` as it was (peft loads no such key). Named ``<module> (full-rank difference)``, so
    none is dropped unsaid; the loader leaves them out (:func:`loadable_state`)."""
    keys = [key for key in file.keys if key.endswith(DIFFERENCES)]
    if not keys:
        return []
    from safetensors import safe_open

    kept_bias = any(key.endswith("lora_B.bias") for key in state)
    left = {key.partition(".")[2] for key in state if key.endswith(DIFFERENCES)}
    dropped = [key for key in keys if "norm" in key.rpartition(".")[0].lower() or key.partition(".")[2] in left
               or (key.endswith(".diff_b") and not kept_bias)]
    with safe_open(str(file.path), framework="pt") as opened:
        held = [key for key in dropped if bool(opened.get_tensor(key).any())]
    return sorted({f"{key.rpartition('.')[0]} (full-rank difference)" for key in held})


def loadable_state(file: LoraFile, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without what the check counted as not applied: the modules it found nothing for
    (a partial load) and the full-rank differences left in it (all zero, or skipped)."""
    skipped = tuple(f"{module}." for module in file.unmatched)
    return {key: value for key, value in state.items() if not key.startswith(skipped) and not key.endswith(DIFFERENCES)}


def _judged(registry: Registry, family: FamilySpec, file: LoraFile, unmatched: Sequence[str], total: int) -> LoraFile:
    """``file`` with its modules counted; refused where nothing in it matches, or where any
    module does not and the caller did not ask for the rest alone (``partial``)."""
    if total == 0 or len(unmatched) == total or (unmatched and not file.partial):
        raise mismatch_error(registry, family, file, list(unmatched) or ["(no adapted module)"], total)
    return dataclasses.replace(file, matched=total - len(unmatched), unmatched=tuple(unmatched))


def _config_root(source: ModelSource) -> str:
    return str(source.base if source.kind in ("single_file", "single_file_pipeline", "gguf") else source.location)


def _pipeline_class(root: str) -> type:
    import diffusers

    return getattr(diffusers, str(_index(root)["_class_name"]))


def _index(root: str) -> dict[str, Any]:
    """The pipeline's index, classic or modular (its components as ``[library, class]``), from a
    local folder or the hub's cache."""
    from pathlib import Path

    from engine.preflight.pipeline_index import read_index

    index = read_index(Path(root))
    if index is None:
        import diffusers

        return dict(diffusers.DiffusionPipeline.load_config(root))
    return {"_class_name": index.class_name, **index.components}


class _Skeleton:
    """A pipeline's components built lazily on the ``meta`` device: its module
    tree and shapes, no weights and no memory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.index = _index(root)
        self._built: dict[str, torch.nn.Module | None] = {}

    def unet_config(self) -> Any:
        entry = self.index.get("unet")
        if not isinstance(entry, (list, tuple)) or entry[0] is None:
            return None
        import diffusers

        return getattr(diffusers, entry[1]).load_config(self.root, subfolder="unet")

    def get(self, name: str) -> torch.nn.Module | None:
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _build(self, name: str) -> torch.nn.Module | None:
        entry = self.index.get(name)
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] is None:
            return None
        library, class_name = entry
        if library == "transformers":
            import transformers

            cls = getattr(transformers, class_name)
            config = cls.config_class.from_pretrained(self.root, subfolder=name)
            with torch.device("meta"):
                return cls(config)
        # diffusers, or a family's own model class: like diffusers, a module a
        # model folder names is never imported on its say-so, only looked up
        # among those the process has imported.
        module = importlib.import_module("diffusers") if library == "diffusers" else sys.modules.get(library)
        cls = getattr(module, class_name, None)
        if not callable(getattr(cls, "load_config", None)):
            return None
        config = cls.load_config(self.root, subfolder=name)
        with torch.device("meta"):
            return cls.from_config(config)


# -- applying to a loaded pipeline -------------------------------------------------------
