"""A diffusers modular pipeline as the engine's runtime calls a pipeline.

Some models exist only as a ``ModularPipeline``: blocks that run in
sequence over a shared state, components held by a ``ComponentsManager``, called with
``pipe(prompt=..., output=[...])``. :class:`ModularRun` puts one behind the surface the
rest of the runtime already uses for a ``DiffusionPipeline`` (its components as
attributes and in ``components``, a call with the usual keyword names that returns
``.frames`` / ``.images`` and ``.audio``, the three offload modes, the progress bar), so
the plan, the LoRA path, the step callback, the cancel points and the outputs serve it
unchanged.

Loading trusts nothing the folder's ``modular_model_index.json`` says about places: its
loading specs name a hub repo or the saving machine's absolute paths. Each component the
pipeline's own blocks expect is loaded, as the class the blocks declare, from the
subfolder of that name in the folder being loaded, with no network; the index gives only
which components the folder holds and its config values (a canvas size, say).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.contract.types import FamilySpec
from engine.preflight.pipeline_index import PipelineIndex
from engine.runtime.processors import build_processor

#: What a modular call hands back, by the names its decode blocks give them.
OUTPUTS = ("videos", "images", "audio", "sampling_rate")


def load_modular(folder: Path, index: PipelineIndex, family: FamilySpec, dtypes: Any) -> ModularRun:
    """The modular pipeline saved in ``folder`` (its ``index`` read by the preflight), each of its
    components loaded from its own subfolder in its dtype (``dtypes``: one, or a mapping by
    component with a ``default``, as diffusers' ``from_pretrained`` takes)."""
    import diffusers
    from diffusers import ComponentsManager

    pipeline_cls = getattr(diffusers, index.class_name)  # one of the family's classes: the preflight said so
    manager = ComponentsManager()
    blocks = getattr(diffusers, pipeline_cls.default_blocks_name)()
    for step, component in family.pipeline.optional_steps:  # a step whose component the folder lacks
        if component not in index.components and step in blocks.sub_blocks:
            blocks.sub_blocks.pop(step)
    configs = {name: value for name, value in index.entries.items()
               if not name.startswith("_") and name not in index.components}
    pipe = pipeline_cls(blocks=blocks, components_manager=manager, modular_config_dict=configs)
    loaded: dict[str, Any] = {}
    for name in pipe.pretrained_component_names:
        if name not in index.components or name in family.pipeline.unused_components:
            continue
        spec = pipe.get_component_spec(name)
        kind = spec.type_hint if isinstance(spec.type_hint, type) else type(None)
        if kind.__module__.startswith("transformers") and kind.__name__.endswith("Processor"):
            loaded[name] = build_processor(folder / name, kind.__name__)  # built without torchvision where need be
            continue
        extra = {"dtype": _dtype_of(dtypes, name)} if issubclass(kind, torch.nn.Module) else {}
        loaded[name] = spec.load(pretrained_model_name_or_path=str(folder), subfolder=name, variant=None,
                                 revision=None, local_files_only=True, **extra)
    pipe.update_components(**loaded)
    return runner_class(pipeline_cls)(pipe, manager)


def open_pipeline(folder: Path, family: FamilySpec, dtypes: Any = torch.float32) -> Any:
    """The pipeline saved in ``folder`` as the runtime holds it, with no plan: a modular one
    behind :class:`ModularRun`, a classic one with its processors built here."""
    import diffusers

    from engine.preflight.pipeline_index import modular_index
    from engine.runtime.processors import pipeline_processors

    index = modular_index(folder)
    if index is not None:
        return load_modular(folder, index, family, dtypes)
    return diffusers.DiffusionPipeline.from_pretrained(folder, dtype=dtypes, **pipeline_processors(str(folder)))


def _dtype_of(dtypes: Any, name: str) -> torch.dtype:
    if isinstance(dtypes, dict):
        return dtypes.get(name, dtypes["default"])
    return dtypes


@cache
def runner_class(pipeline_cls: type) -> type[ModularRun]:
    """:class:`ModularRun` with the modular pipeline's LoRA loader mixins (its class-level
    ``lora_state_dict`` and ``save_lora_weights``, which the LoRA check and the trainer's
    export call on the pipeline's type)."""
    from diffusers.loaders.lora_base import LoraBaseMixin

    mixins = tuple(base for base in pipeline_cls.__bases__ if issubclass(base, LoraBaseMixin))
    return type(f"{pipeline_cls.__name__}Run", (ModularRun, *mixins), {"__module__": __name__})


class ModularRun:
    """A ``ModularPipeline`` and its ``ComponentsManager``, called as the runtime calls a
    ``DiffusionPipeline``. Attributes it does not hold are the pipeline's (its components,
    its LoRA loader)."""

    def __init__(self, pipe: Any, manager: Any) -> None:
        self._pipe = pipe
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A component set on the runner is the pipeline's (and its manager's): ``update_components``."""
        if not name.startswith("_") and name in self._pipe.component_names:
            self._pipe.update_components(**{name: value})
        else:
            object.__setattr__(self, name, value)

    @property
    def modular_class(self) -> str:
        """The modular pipeline's class name: the one a family's workflows name."""
        return type(self._pipe).__name__

    @property
    def components(self) -> dict[str, Any]:
        """The loaded components, by name (the ones never loaded left out)."""
        return {name: value for name, value in self._pipe.components.items() if value is not None}

    def __call__(
        self,
        prompt: list[str] | str,
        num_inference_steps: int,
        generator: list[torch.Generator] | torch.Generator | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        image: Any = None,
        output_type: str = "pil",
    ) -> SimpleNamespace:
        """One call of the blocks per prompt (a modular pipeline packs one request into one
        sequence), each with its own generator; the clips or images, and the sound, gathered."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        generators = generator if isinstance(generator, list) else [generator] * len(prompts)
        asked = {"height": height, "width": width, "num_frames": num_frames, "image": image}
        results = []
        for text, seed in zip(prompts, generators, strict=True):
            state = self._pipe(prompt=text, num_inference_steps=num_inference_steps, generator=seed,
                               output_type=output_type, output=list(self._outputs()),
                               **{key: value for key, value in asked.items() if value is not None})
            results.append(state)
        return _gathered(results)

    def _outputs(self) -> tuple[str, ...]:
        said = {param.name for param in self._pipe.blocks.outputs}
        return tuple(name for name in OUTPUTS if name in said)

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self._pipe.set_progress_bar_config(**kwargs)

    def to(self, device: str | torch.device) -> ModularRun:
        self._pipe.to(device)
        return self

    def enable_model_cpu_offload(self, device: str | torch.device = "cuda") -> None:
        """Each model on the device while it runs: the ``ComponentsManager``'s own offload."""
        self._manager.enable_auto_cpu_offload(device=device)

    def enable_sequential_cpu_offload(self, device: str | torch.device = "cuda") -> None:
        """Every weight on the device only while its layer runs (accelerate's hooks)."""
        from accelerate import cpu_offload

        for module in self._modules():
            cpu_offload(module, execution_device=torch.device(device))

    def enable_group_offload(self, **kwargs: Any) -> None:
        """Groups of blocks brought onto the device ahead of use (diffusers' group offload)."""
        from diffusers.hooks import apply_group_offloading

        for module in self._modules():
            apply_group_offloading(module, **kwargs)

    def _modules(self) -> list[torch.nn.Module]:
        return [value for value in self.components.values() if isinstance(value, torch.nn.Module)]


def _gathered(states: list[dict[str, Any]]) -> SimpleNamespace:
    """The per-prompt outputs as one result: ``frames`` (a clip per prompt), ``images``,
    ``audio`` (batch, channels, samples) and its ``sampling_rate``."""
    result = SimpleNamespace()
    if all("videos" in state for state in states):
        result.frames = [clip for state in states for clip in _clips(state["videos"])]
    if all("images" in state for state in states):
        result.images = [image for state in states for image in state["images"]]
    if all(state.get("audio") is not None for state in states):
        result.audio = torch.cat([state["audio"].reshape(-1, *state["audio"].shape[-2:]) for state in states])
        result.sampling_rate = int(states[0]["sampling_rate"])
    return result


def _clips(videos: Any) -> list[Any]:
    """A decode block's ``videos``: a list of clips (each a list of frames), or one clip."""
    if isinstance(videos, list) and videos and not isinstance(videos[0], (list, tuple)) and hasattr(videos[0], "size"):
        return [videos]  # one clip given as its frames
    return list(videos)
