"""Which pipeline serves a generate: text-to-image, img2img, inpaint or edit.

The family's table (:meth:`engine.contract.types.FamilySpec.workflows_of`) names the
diffusers pipeline class serving each workflow of a checkpoint; this module
picks the workflow from the request's inputs and builds that pipeline from
the loaded one's components with diffusers' ``from_pipe`` (the weights are
shared, nothing is reloaded, LoRAs and the step cache stay on the shared
denoiser). No family is named here.
"""

from __future__ import annotations

import inspect
from typing import Any

from engine.errors import EngineError, UnsupportedWorkflow
from engine.contract.types import Checkpoint, FamilySpec, Workflow


def choose_workflow(
    family: FamilySpec, checkpoint: Checkpoint | None, *, image: bool, mask: bool, control: bool = False
) -> tuple[Workflow, str | None]:
    """The workflow a request's inputs ask for and the pipeline class serving
    it (None: the loaded pipeline itself).

    An image with a mask inpaints; an image alone is an instruction edit on
    a checkpoint that declares ``edit``, img2img otherwise; a control image
    (no image) is ControlNet text-to-image; no image is text-to-image, by the
    loaded pipeline unless the checkpoint names another (an edit pipeline
    that needs an input image).
    """
    if control:
        if image or mask:
            raise UnsupportedWorkflow(
                "control_image (--control-image) with image / mask_image (ControlNet img2img or "
                "inpaint) is not served; give the control image alone"
            )
        served = family.workflows_of(checkpoint)
        if "controlnet" not in served:
            raise UnsupportedWorkflow(
                f"{family.label} declares no ControlNet pipeline; drop control_image (--control-image)"
            )
        return "controlnet", served["controlnet"]
    if not image:
        if mask:
            raise UnsupportedWorkflow("mask_image was given without image; inpainting needs both (--image, --mask)")
        served = family.workflows_of(checkpoint)
        if family.rendering.output == "frames" and "txt2img" not in served:  # an image-to-video checkpoint needs its image
            label = (checkpoint or family.default_checkpoint).label
            raise UnsupportedWorkflow(f"{label} needs an input image (it serves: {', '.join(sorted(served))}); "
                                      "give image (--image)")
        return "txt2img", served.get("txt2img")
    served = family.workflows_of(checkpoint)
    workflow: Workflow = "inpaint" if mask else (
        "edit" if "edit" in served else "img2vid" if family.rendering.output == "frames" else "img2img")
    if workflow not in served:
        label = (checkpoint or family.default_checkpoint).label
        offered = ", ".join(sorted(served)) or "text-to-image only"
        field = "mask_image (--mask)" if mask else "image (--image)"
        raise UnsupportedWorkflow(
            f"{label} has no {workflow} pipeline (it serves: {offered}); drop {field} "
            "or load a checkpoint that serves it"
        )
    return workflow, served[workflow]


def workflow_pipeline(
    loaded: Any, class_name: str | None, cache: dict[str, Any], extra: dict[str, Any] | None = None,
    placement: tuple[str, str] = ("resident", "cpu"),
) -> Any:
    """The pipeline of class ``class_name`` over ``loaded``'s components and
    ``extra`` ones (a ControlNet), cached per class, placed as ``placement``
    (the plan's memory mode and device) says: see :func:`follow_offload`."""
    if class_name is None or class_name in (type(loaded).__name__, getattr(loaded, "modular_class", None)):
        return loaded  # a modular pipeline serves its workflows itself, picked by the inputs given
    if class_name not in cache:
        import diffusers

        pipeline_cls = getattr(diffusers, class_name, None)
        if pipeline_cls is None:
            raise UnsupportedWorkflow(
                f"the installed diffusers has no {class_name}; upgrade diffusers to use this workflow"
            )
        try:
            built = _keeping_dtypes(pipeline_cls).from_pipe(loaded, **(extra or {}))
            built.__class__ = pipeline_cls
        except (ValueError, TypeError, AttributeError) as exc:
            raise UnsupportedWorkflow(
                f"{class_name} cannot be built from the loaded {type(loaded).__name__} ({exc})"
            ) from exc
        built.set_progress_bar_config(disable=True)
        follow_offload(built, extra or {}, *placement)
        cache[class_name] = built
    return cache[class_name]


def _keeping_dtypes(pipeline_cls: Any) -> Any:
    """``pipeline_cls`` whose ``from_pipe`` leaves the shared modules in their dtypes.

    diffusers' ``from_pipe`` ends with ``new_pipeline.to(dtype=...)``, float32 unless told
    another: the modules it shares with the loaded pipeline (the same objects) would be cast with
    it, a bf16 denoiser upcast to fp32 (twice its memory, and another dtype than its plan's) or,
    told bf16, a VAE the family keeps in fp32 cast down. The loaded pipeline's dtypes are the
    plan's; the new pipeline keeps them (its class is put back once built)."""

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and set(kwargs) == {"dtype"}:
            return self
        return pipeline_cls.to(self, *args, **kwargs)

    return type(pipeline_cls.__name__, (pipeline_cls,), {"to": to, "__module__": pipeline_cls.__module__})


def follow_offload(built: Any, extra: dict[str, Any], mode: str, device: str) -> None:
    """Give a pipeline built with ``from_pipe`` the loaded one's offload.

    ``from_pipe`` shares the modules, and with them whatever hooks are on
    them, but not the pipeline's own offload record: under model offload the
    new pipeline would never offload its last model (its ``_all_hooks`` is
    empty, so the end-of-call reset is skipped) and a module it adds (a
    ControlNet) would have no hook at all, left on the host while its inputs
    are on the device. So the new pipeline enables the same offload over its
    own components, as diffusers' own ``from_pipe`` offload tests do; the
    loaded pipeline re-installs its hooks at the end of each of its calls
    (diffusers' ``maybe_free_model_hooks``), so the two alternate safely.
    Group offload's hooks live on the modules and travel with them; only an
    added module gets its own.
    """
    if mode == "model_offload":
        built.enable_model_cpu_offload(device=device)
    elif mode == "sequential_offload":
        built.enable_sequential_cpu_offload(device=device)
    elif mode == "group_offload":
        import torch
        from diffusers.hooks.group_offloading import _is_group_offload_enabled

        for module in extra.values():
            if isinstance(module, torch.nn.Module) and not _is_group_offload_enabled(module):
                module.enable_group_offload(
                    onload_device=torch.device(device), offload_device=torch.device("cpu"),
                    offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                )


def strength_of(pipe: Any, strength: float | None) -> float | None:
    """The strength the call runs at: the request's, else the pipeline's
    default; None where the pipeline takes no strength (text-to-image, edit)."""
    parameter = inspect.signature(pipe.__call__).parameters.get("strength")
    if parameter is None:
        return None
    if strength is not None:
        return strength
    return float(parameter.default) if isinstance(parameter.default, int | float) else 1.0


def effective_steps(steps: int, strength: float | None) -> int:
    """Denoising steps that really run: diffusers' img2img pipelines run the
    last ``min(int(steps * strength), steps)`` of the schedule (it starts
    part-way), so 1 step at strength 0.9 runs none."""
    if strength is None:
        return steps
    return min(int(steps * strength), steps)


def load_controlnet(family: FamilySpec, path: str, dtype: Any, device: str) -> Any:
    """The ControlNet at ``path`` (a diffusers folder), as the family's first
    declared ControlNet class, in the pipeline's dtype on ``device``."""
    import diffusers

    if not family.pipeline.controlnet_classes:
        raise UnsupportedWorkflow(f"{family.label} declares no ControlNet class; load without a ControlNet")
    cls = getattr(diffusers, family.pipeline.controlnet_classes[0])
    try:
        return cls.from_pretrained(path, dtype=dtype).to(device).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        raise UnsupportedWorkflow(
            f"could not load the ControlNet at {path} as {cls.__name__} ({exc}); give a diffusers "
            f"ControlNet folder made for {family.label}"
        ) from exc


def control_input(image: Any, preprocess: str) -> Any:
    """The control map for ``image``: its Canny edges, or the image as given (``none``)."""
    from engine.runtime.inputs import canny_map, read_image

    if preprocess not in ("canny", "none"):
        raise EngineError(
            f"control_preprocess {preprocess!r} is unknown; use canny or none", code="invalid_request"
        )
    picture = read_image(image, "control_image")
    return canny_map(picture) if preprocess == "canny" else picture

