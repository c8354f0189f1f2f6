"""LoRA adapters on a pipeline, through diffusers' loaders and peft.

Every input format diffusers knows (diffusers / peft, kohya sd-scripts with
``lora_te*`` text-encoder keys, ai-toolkit, ComfyUI) is converted by the
pipeline class's own ``lora_state_dict``; the engine writes no key converter
of its own. Before anything is applied (and, on a load, before anything is
evicted) every converted key is checked against the model's module tree,
names and shapes: a file with any key that lands nowhere is refused with the
family it looks like and the count, never half-applied. The check runs on a
skeleton of the model built on the ``meta`` device (no weights, no memory)
when the model is not loaded yet, on the loaded pipeline otherwise.

How adapters are applied follows the plan's ``lora`` control: ``fused``
(merged into the weights), ``unfused`` (peft layers beside the base, several
LoRAs, quantised and GGUF bases) or ``hotswap`` (unfused, in slots of the
largest rank declared before the denoiser is compiled, so a switch reuses
the compiled graph). Switching LoRAs or scales never reloads the base.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.preflight.lora import LoraFile, LoraMismatch, mismatch_error
from engine.preflight.source import ModelSource
from engine.runtime.quantize import first_line
from engine.contract.types import FamilySpec

_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoraLoadFailed(EngineError):
    code = "lora_load_failed"


# -- conversion and matching ---------------------------------------------------------


def converted_state_dict(
    pipeline_cls: type, file: LoraFile, unet_config: Any = None, *,
    family: FamilySpec | None = None, denoiser: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """``file`` in diffusers' keys (``<component>.<module>...``), converted by
    ``pipeline_cls.lora_state_dict`` exactly as ``load_lora_weights`` does; a kohya file
    of ``family`` with fused modules is split with ``denoiser``'s own widths first
    (:func:`engine.runtime.kohya.diffusers_from_kohya`: diffusers' converter assumes
    the full-size model's)."""
    from safetensors.torch import load_file

    state = load_file(str(file.path))
    if family is not None and denoiser is not None and family.lora.kohya_map:
        from engine.runtime.kohya import diffusers_from_kohya

        linears = {name: int(getattr(getattr(m, "base_layer", m), "out_features"))
                   for name, m in denoiser.named_modules()
                   if hasattr(getattr(m, "base_layer", m), "out_features") and "lora_" not in name}
        split = diffusers_from_kohya(family, state, linears)
        if split is not None:
            return {f"{family.denoiser}.{key}": value for key, value in split.items()}
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


def check_loras(registry: Registry, source: ModelSource, files: Sequence[LoraFile]) -> None:
    """Refuse (:class:`LoraMismatch`) a LoRA with any key that does not land on
    ``source``'s model; checked on a weightless ``meta`` skeleton of it."""
    if not files:
        return
    root = _config_root(source)
    pipeline_cls = _pipeline_class(root)
    skeleton = _Skeleton(root)
    for file in files:
        state = converted_state_dict(pipeline_cls, file, unet_config=skeleton.unet_config(),
                                     family=source.family, denoiser=skeleton.get(source.family.denoiser))
        components = {name: skeleton.get(name) for name in {k.partition(".")[0] for k in state}}
        present = {name: model for name, model in components.items() if model is not None}
        _refuse_unmatched(registry, source.family, file, state, present)


def check_on_pipeline(registry: Registry, family: FamilySpec, pipe: Any, files: Sequence[LoraFile]) -> None:
    """The same check against a loaded pipeline's own modules."""
    components = {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
    unet = components.get("unet")
    for file in files:
        state = converted_state_dict(type(pipe), file, unet_config=getattr(unet, "config", None),
                                     family=family, denoiser=components.get(family.denoiser))
        _refuse_unmatched(registry, family, file, state, components)


def _refuse_unmatched(
    registry: Registry, family: FamilySpec, file: LoraFile,
    state: Mapping[str, torch.Tensor], components: Mapping[str, torch.nn.Module],
) -> None:
    unmatched, total = unmatched_modules(state, components)
    if unmatched or total == 0:
        raise mismatch_error(registry, family, file, unmatched or ["(no adapted module)"], total)


def _config_root(source: ModelSource) -> str:
    return str(source.base if source.kind in ("single_file", "single_file_pipeline", "gguf") else source.location)


def _pipeline_class(root: str) -> type:
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(root)
    return getattr(diffusers, str(index["_class_name"]))


class _Skeleton:
    """A pipeline's components built lazily on the ``meta`` device: its module
    tree and shapes, no weights and no memory."""

    def __init__(self, root: str) -> None:
        import diffusers

        self.root = root
        self.index = diffusers.DiffusionPipeline.load_config(root)
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


class LoraSet:
    """The LoRAs applied to one pipeline, and how (the plan's ``lora`` control)."""

    def __init__(self, pipe: Any, mode: str, max_rank: int, hooks: HookAdapters | None = None,
                 family: FamilySpec | None = None) -> None:
        self.pipe = pipe
        #: The family, whose kohya files with fused modules are split with the model's widths.
        self.family = family
        #: Set where the pipeline has no diffusers LoRA loader: LoRAs load
        #: through the ``engine_lora_load`` hook, unfused.
        self.hooks = hooks
        self.mode = "unfused" if hooks is not None else mode
        self.max_rank = max_rank
        self.applied: tuple[LoraFile, ...] = ()
        #: adapter name per loaded file (unfused / fused); slot names under hotswap.
        self._names: dict[Path, str] = {}
        self._slots: list[str] = []
        self._fused = False
        self._hotswap_ready = False
        self._counter = 0

    def prepare_hotswap(self) -> None:
        """Declare the slot rank before the first adapter is loaded and before compile."""
        if self.mode == "hotswap" and not self._hotswap_ready:
            self.pipe.enable_lora_hotswap(target_rank=max(self.max_rank, 1))
            self._hotswap_ready = True

    def apply(self, files: Sequence[LoraFile]) -> None:
        """Make ``files`` (with their scales) the pipeline's LoRAs; a no-op where they already are."""
        files = tuple(files)
        if files == self.applied:
            return
        try:
            self._unfuse()
            if self.mode == "hotswap":
                self._apply_hotswap(files)
            else:
                self._apply_adapters(files)
        except (ValueError, RuntimeError, KeyError, AssertionError, IndexError) as exc:
            raise LoraLoadFailed(
                f"applying LoRA(s) {', '.join(str(f.path) for f in files)} failed: "
                f"{first_line(exc)[:300]}"
            ) from exc
        self.applied = files

    def _apply_adapters(self, files: tuple[LoraFile, ...]) -> None:
        wanted = {f.path for f in files}
        stale = [name for path, name in self._names.items() if path not in wanted]
        if stale:
            if self.hooks is not None:
                self.hooks.delete(stale)
            else:
                self.pipe.delete_adapters(stale)
            self._names = {p: n for p, n in self._names.items() if p in wanted}
        for file in files:
            if file.path not in self._names:
                name = self._new_name()
                if self.hooks is not None:
                    self.hooks.load(file, name)
                else:
                    self.pipe.load_lora_weights(self._loadable(file), adapter_name=name)
                self._names[file.path] = name
        if not files:
            return
        names = [self._names[f.path] for f in files]
        if self.hooks is not None:
            self.hooks.activate(names, [f.scale for f in files])
            return
        self.pipe.set_adapters(names, adapter_weights=[f.scale for f in files])
        if self.mode == "fused" and len(files) == 1:
            self.pipe.fuse_lora(components=self._lora_components(), adapter_names=names)
            self._fused = True

    def _apply_hotswap(self, files: tuple[LoraFile, ...]) -> None:
        self.prepare_hotswap()
        for index, file in enumerate(files):
            if file.rank > self.max_rank:
                raise ValueError(
                    f"{file.path} has rank {file.rank}, above the rank-{self.max_rank} hot-swap slots "
                    "declared at load; load the model again with this LoRA among its LoRAs"
                )
            if index < len(self._slots):
                self.pipe.load_lora_weights(self._loadable(file), adapter_name=self._slots[index], hotswap=True)
            else:
                name = f"slot{index}"
                self.pipe.load_lora_weights(self._loadable(file), adapter_name=name)
                self._slots.append(name)
        if self._slots:
            # Unused slots stay loaded at weight 0: removing them would recompile.
            weights = [f.scale for f in files] + [0.0] * (len(self._slots) - len(files))
            self.pipe.set_adapters(self._slots, adapter_weights=weights)

    def _loadable(self, file: LoraFile) -> str | dict[str, torch.Tensor]:
        """What ``load_lora_weights`` takes for ``file``: its path, or, for a kohya file with
        fused modules, the state split with this model's widths (diffusers assumes the
        full-size model's)."""
        if self.family is None or not self.family.lora.kohya_map or not any(
                key.startswith("lora_unet_") for key in file.keys):
            return str(file.path)
        state = converted_state_dict(type(self.pipe), file, family=self.family,
                                     denoiser=getattr(self.pipe, self.family.denoiser))
        return state if all(key.startswith(f"{self.family.denoiser}.") for key in state) else str(file.path)

    def _unfuse(self) -> None:
        if self._fused:
            self.pipe.unfuse_lora(components=self._lora_components())
            self._fused = False

    def _lora_components(self) -> list[str]:
        return [name for name in self.pipe._lora_loadable_modules if getattr(self.pipe, name, None) is not None]

    def _new_name(self) -> str:
        self._counter += 1
        return f"lora{self._counter}"

    def status(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "fused": self._fused,
            "applied": [f.to_dict() for f in self.applied],
        }


class HookAdapters:
    """LoRAs on a pipeline without diffusers' LoRA loader mixin: each file is
    loaded into the denoiser through the ``engine_lora_load`` hook, and peft's
    layers are switched and scaled directly."""

    def __init__(self, registry: Registry, family: FamilySpec, pipe: Any) -> None:
        self.registry = registry
        self.family = family
        self.pipe = pipe

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipe, self.family.denoiser)

    def load(self, file: LoraFile, name: str) -> None:
        state = converted_state_dict(type(self.pipe), file, family=self.family, denoiser=self.denoiser)
        prefix = self.family.denoiser + "."
        others = sorted({k.partition(".")[0] for k in state if not k.startswith(prefix)})
        if others:
            raise ValueError(
                f"{file.path} also adapts {', '.join(others)}; {type(self.pipe).__name__} has no "
                f"diffusers LoRA loader, so only {self.family.denoiser} LoRAs load"
            )
        self.registry.lora_load(self.family, self.pipe, {k[len(prefix):]: v for k, v in state.items()}, name)

    def delete(self, names: list[str]) -> None:
        from engine.runtime.adapters import delete

        delete(self.denoiser, names)

    def activate(self, names: list[str], scales: list[float]) -> None:
        from engine.runtime.adapters import set_scales

        set_scales(self.denoiser, names, scales)
