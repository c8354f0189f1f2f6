"""A generate call on a loaded pipeline: the request, its workflow, its batches.

The generate half of :class:`~engine.runtime.session.InferenceSession`: which
workflow pipeline a request takes (txt2img, img2img, inpaint, edit,
ControlNet; see :mod:`engine.runtime.workflows`), its inputs fitted to the
model's side multiple, one generator per image, the images run in chunks that
halve on out-of-memory (see :mod:`engine.runtime.batching`), and the keyword
arguments each chunk's pipeline call gets (only those it accepts, then the
family's ``engine_generate_kwargs`` hook).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from PIL import Image

from engine.runtime import family_hooks
from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.policy.lora_sampling import sampling_of
from engine.runtime.scheduler_shift import shifted
from engine.policy.plan import Plan
from engine.preflight.lora import LoraFile
from engine.preflight.source import ModelSource
from engine.runtime import batching, prompt_cache, text_encoders, workflows
from engine.runtime.inputs import FittedInputs, ImageLike, fit_inputs, paste_unmasked, vae_dtype
from engine.runtime.call_arguments import call_shape, clip_kwargs, guidance_of, schedule_of
from engine.runtime.guiders import set_component_guidance
from engine.runtime.interrupt import cancel_points
from engine.runtime.loading import Progress
from engine.runtime.outputs import with_sound
from engine.runtime.vae import apply_vae_tiling

log = logging.getLogger(__name__)


def _call_pipe(pipe: Any, call: dict[str, Any], encoded_again: Callable[[], dict[str, Any]] | None) -> Any:
    """``pipe(**call)``; where its prompt embeddings came from disk (``encoded_again`` given) and
    the call fails with them (a planted or stale cache entry), the call is made once more with
    the prompts encoded again (the entry rewritten). Out of memory is the batching's to handle."""
    try:
        with torch.inference_mode(), _stepping(pipe, call):
            return pipe(**call)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as exc:
        if encoded_again is None or isinstance(exc, torch.OutOfMemoryError):
            raise
        log.warning("generate failed with cached prompt embeddings (%s); encoding them again", exc)
        retry = encoded_again()
        with torch.inference_mode(), _stepping(pipe, retry):
            return pipe(**retry)


@contextlib.contextmanager
def _stepping(pipe: Any, call: dict[str, Any]) -> Iterator[None]:
    """A pipeline whose call takes no step callback (its CFG on a guider, say) still reports each step
    (and so stops there when cancelled): its scheduler's ``step`` calls the callback after it
    returns, for this call only. A pipeline that takes the callback is left as it is."""
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters or "callback_on_step_end" not in call:
        yield
        return
    callback = call.pop("callback_on_step_end")
    scheduler = pipe.scheduler
    step = scheduler.step
    done = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        callback(pipe, done[0], None, {})
        done[0] += 1
        return result

    scheduler.step = counted
    try:
        yield
    finally:
        del scheduler.step  # the class's own method again


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generate call's inputs, as the service builds them from an HTTP or
    CLI request; ``None`` leaves a value to the checkpoint or the plan."""

    prompt: str
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int = 0
    count: int = 1
    negative_prompt: str | None = None
    #: The LoRAs (with scales) to generate with; None keeps those applied now.
    loras: tuple[LoraFile, ...] | None = None
    #: An input image (path, encoded bytes or PIL image): img2img, or an
    #: instruction edit on an edit checkpoint (see :mod:`engine.runtime.workflows`).
    image: ImageLike | Sequence[ImageLike] | None = None
    #: White where ``image`` is redrawn (inpaint); needs ``image``.
    mask_image: ImageLike | None = None
    #: How much of ``image`` is redrawn (0-1); None: the pipeline's default.
    strength: float | None = None
    #: One prompt / seed per image (a list of one is repeated); empty: ``count``
    #: images of ``prompt`` with seeds ``seed, seed + 1, ...``.
    prompts: tuple[str, ...] = ()
    seeds: tuple[int, ...] = ()
    #: Images per forward; None: as the memory plan allows (one on the CPU).
    batch: int | None = None
    #: A control image for the loaded ControlNet, made a map by ``control_preprocess``
    #: (``canny`` edges, or ``none``: the image is the map); its strength.
    control_image: ImageLike | None = None
    control_preprocess: str = "canny"
    control_scale: float | None = None
    #: A video family's clip: frames (on its lattice; None: the checkpoint's default) and
    #: the fps the clip is stamped with (None: the checkpoint's). Images: both None.
    frames: int | None = None
    fps: int | None = None
    #: A two-expert model's low-noise guidance (``guidance_scale_2``); None: the checkpoint's.
    guidance_2: float | None = None


class Generation:
    """Mixin of :class:`~engine.runtime.session.InferenceSession`: runs a
    :class:`GenerateRequest` on the loaded pipeline, serialised by the
    session's lock. It switches LoRAs through the session's ``set_loras`` and
    re-decides the step cache and compile through :class:`SpeedControls`
    (:mod:`engine.runtime.speedups`) before every call."""

    registry: Registry
    source: ModelSource
    plan: Plan
    pipeline: Any
    vae_tiled: bool
    batch_events: list[dict[str, object]]
    encoder_stream: text_encoders.EncoderStream | None
    request: Any
    loras: Any
    _root: Callable[[], str]
    _lock: threading.Lock
    _controlnet: Any
    _workflow_pipes: dict[str, Any]
    _active: Any
    _images: int
    _store_compile_cache: Any
    text_kv: Any

    def generate(self, request: GenerateRequest, progress: Progress | None = None,
                 cancel: threading.Event | None = None) -> list[Image.Image]:
        """The request's images: its workflow's pipeline (built over the loaded
        components), its inputs fitted, one generator per image, in chunks
        (halved on out-of-memory; see :mod:`engine.runtime.batching`).
        ``cancel`` is honoured inside a step, before each block of the pipeline's models
        runs (the tiled decode's too; :mod:`engine.runtime.interrupt`), and at each step's
        end through ``progress`` (the caller's step callback raises)."""
        with self._lock:
            family = self.source.family
            control = request.control_image is not None
            workflow, class_name = workflows.choose_workflow(
                family, self.source.checkpoint, image=request.image is not None,
                mask=request.mask_image is not None, control=control,
            )
            if control and self._controlnet is None:
                raise workflows.UnsupportedWorkflow(
                    "control_image needs a ControlNet loaded with the model; load with controlnet=PATH (--controlnet)"
                )
            extra = {"controlnet": self._controlnet} if control else None
            placement = (str(self.plan.value("memory_mode")), self.plan.device)
            pipe = workflows.workflow_pipeline(self.pipeline, class_name, self._workflow_pipes, extra, placement)
            picture = workflows.control_input(request.control_image, request.control_preprocess) if control else request.image
            video = family.video_of(self.source.checkpoint)
            fitted = fit_inputs(
                picture, request.mask_image, width=request.width, height=request.height,
                multiple=video.size_multiple if video is not None else family.rendering.sides, dtype=vae_dtype(pipe),
                alpha=family.rendering.alpha,
            )
            if control:
                fitted = dataclasses.replace(fitted, control=True)
            sampling = self._lora_sampling(request)  # a few-step LoRA's steps and guidance, where asked none
            steps = request.steps or (sampling.steps if sampling is not None and sampling.steps else None) \
                or self.plan.default_steps
            strength = workflows.strength_of(pipe, request.strength) if workflow != "txt2img" else None
            effective = workflows.effective_steps(steps, strength)
            if effective < 1:
                raise EngineError(
                    f"strength {strength} x {steps} steps runs no denoising step; raise strength or steps",
                    code="invalid_request",
                )
            items = batching.batch_items(
                request.prompt, prompts=request.prompts, seeds=request.seeds, seed=request.seed,
                count=request.count, negative_prompt=request.negative_prompt,
            )
            if request.loras is not None:
                self.set_loras(request.loras)
            self._active = pipe
            if self.text_kv is not None:
                self.text_kv.reset()  # a LoRA or its scale may have changed since the last call
            try:
                self._recheck_step_cache(effective)
                self._images += 1
                if self._images > 1:
                    self._apply_compile(self._images)
                with cancel_points(pipe, cancel), shifted(pipe, sampling.shift if sampling is not None else None):
                    images = self._run_batch(pipe, request, steps, effective, strength, fitted, items, progress)
            finally:
                self._active = None
            if images and family.rendering.output == "images":
                self._store_compile_cache(images[0].width, images[0].height, len(images))
            if workflow == "inpaint" and fitted.original is not None and fitted.mask is not None:
                images = [paste_unmasked(image, fitted.original, fitted.mask) for image in images]
            return images

    def _run_batch(
        self, pipe: Any, request: GenerateRequest, steps: int, effective: int, strength: float | None,
        fitted: FittedInputs, items: list[batching.BatchItem], progress: Progress | None,
    ) -> list[Image.Image]:
        estimate = self.plan.estimate
        size = batching.chunk_size(
            len(items), self.plan.device, requested=request.batch,
            free_gb=estimate.budget_gb - estimate.peak_gb, per_image_gb=estimate.peak_gb - estimate.resident_gb,
        )
        done = [0]  # denoising steps finished over every chunk
        planned = effective * -(-len(items) // size)

        def forward(chunk: list[batching.BatchItem]) -> list[Image.Image]:
            before = done[0]

            def call_kwargs() -> dict[str, Any]:  # fresh generators each time: a retry draws the same noise
                kwargs = self._call_kwargs(pipe, request, steps, chunk, fitted, strength)
                if progress is not None:
                    def on_step(_pipe: Any, step: int, _t: Any, _kw: dict[str, Any]) -> dict[str, Any]:
                        done[0] = before + step + 1
                        progress(done[0], max(done[0], planned))
                        return {}

                    kwargs["callback_on_step_end"] = on_step
                return kwargs

            kwargs = call_kwargs()
            self.vae_tiled = apply_vae_tiling(pipe, self.plan, kwargs.get("width"), kwargs.get("height"))
            stream = self.encoder_stream
            brought = [False]

            def bring() -> None:  # streamed encoders come in only when a prompt is encoded
                if stream is not None and not brought[0]:
                    stream.before_call(pipe)
                    brought[0] = True

            call, hit = self._cached_prompts(pipe, kwargs, bring) or (kwargs, False)
            if hit and stream is not None:
                stream.release_now(pipe)  # from disk: the encoders are not needed
            elif call is kwargs:
                bring()

            def encoded_again() -> dict[str, Any]:  # the call made anew, its prompts encoded afresh
                done[0] = before
                fresh = call_kwargs()
                again = self._cached_prompts(pipe, fresh, bring, refresh=True)
                return again[0] if again is not None else fresh

            try:
                result = _call_pipe(pipe, call, encoded_again if hit else None)
            finally:
                if stream is not None:
                    stream.after_call()
            family = self.source.family
            outputs = family_hooks.pipeline_output(self.registry, family, pipe, result)  # engine_pipeline_output
            sounds = family_hooks.pipeline_sound(self.registry, family, family.video_of(self.source.checkpoint),
                                                 pipe, result)  # engine_pipeline_sound
            return with_sound(outputs, sounds) if sounds else outputs

        def on_split(event: batching.SplitEvent) -> None:
            self.batch_events = [*self.batch_events[-19:], event.to_dict()]

        return batching.run_chunked(items, size, forward, on_split)

    def _cached_prompts(
        self, pipe: Any, kwargs: dict[str, Any], before_encode: Callable[[], None], *, refresh: bool = False,
    ) -> tuple[dict[str, Any], bool] | None:
        """``kwargs`` with its prompts replaced by embeddings from the on-disk
        cache (encoded and written on a miss), and whether they came from disk;
        None where the request turned the cache off, the family's runtime
        module cannot encode a call's prompts, or the workflow's prompt is
        encoded with its image (see :mod:`engine.runtime.prompt_cache`)."""
        if not getattr(self.request, "prompt_cache", True):
            return None
        if "prompt_embeds" not in inspect.signature(pipe.__call__).parameters:
            return None
        family = self.source.family
        scheme = str(self.plan.value("text_encoder_quant", "none"))
        prompts = prompt_cache.for_pipeline(
            family.runtime_module, self._root(),
            {"family": family.name, "dtype": str(self.plan.value("dtype")), "device": self.plan.device,
             "text_encoder_quant": scheme},
            loras=self.loras.applied if self.loras is not None else (),
            identity=self._encoder_identity,
        )
        return prompts.replace(pipe, kwargs, before_encode, refresh=refresh)

    @functools.cached_property
    def _encoder_identity(self) -> str:
        """The loaded encoders' identity for the prompt cache: their files do not
        change while loaded, so they are walked once per load, not per batch."""
        return prompt_cache.encoder_identity(self._root())

    def _lora_sampling(self, request: GenerateRequest) -> Any:
        """The sampling the call's LoRAs set (the request's, else those applied)."""
        applied = self.loras.applied if self.loras is not None else ()
        return sampling_of(self.source.family, request.loras if request.loras is not None else applied)

    def _call_kwargs(
        self, pipe: Any, request: GenerateRequest, steps: int, chunk: Sequence[batching.BatchItem],
        fitted: FittedInputs, strength: float | None,
    ) -> dict[str, Any]:
        family = self.source.family
        checkpoint = self.source.checkpoint or family.default_checkpoint
        sampling = self._lora_sampling(request)
        guidance = guidance_of(request, checkpoint, sampling)
        accepted = inspect.signature(pipe.__call__).parameters
        kwargs: dict[str, Any] = {
            "prompt": [item.prompt for item in chunk],
            "num_inference_steps": steps,
            "num_images_per_prompt": 1,
            "generator": batching.generators([item.seed for item in chunk]),
            family.pipeline.guidance_kwarg: guidance,
            "sigmas": schedule_of(checkpoint),
        }
        width, height = (fitted.width, fitted.height) if fitted.image is not None else (request.width, request.height)
        if not (width or height) and self.plan.default_size is not None:
            width, height = self.plan.default_size  # the model's own size (a tiny pipeline's 64 px)
        if width:
            kwargs["width"] = width
        if height:
            kwargs["height"] = height
        if width and height:
            kwargs["max_area"] = width * height  # edit pipelines scale their output to this area
        if fitted.image is not None and family.rendering.output == "frames":
            kwargs["image"] = fitted.original  # a video pipeline's processor takes the fitted picture
        elif fitted.references or (checkpoint.reference_images > 1 and fitted.original is not None
                                   and fitted.mask is None and not fitted.control):
            # A multi-reference edit pipeline takes its pictures as a list, one image or several.
            kwargs["image"] = [fitted.original, *fitted.references]
        elif fitted.image is not None:
            # A ControlNet pipeline takes its map as ``control_image`` where it
            # has that parameter (and its img2img input as ``image``), else as ``image``.
            kwargs["control_image" if fitted.control and "control_image" in accepted else "image"] = fitted.image
            kwargs["_auto_resize"] = False  # fitted already, to the requested box at the model's multiple
        if fitted.mask is not None:
            kwargs["mask_image"] = fitted.mask
        if strength is not None:
            kwargs["strength"] = strength
        if request.control_scale is not None:
            kwargs["controlnet_conditioning_scale"] = request.control_scale
        if family.rendering.output == "frames":
            kwargs.update(clip_kwargs(request, checkpoint, family.video_of(checkpoint), sampling))
        negative = request.negative_prompt
        if negative is None and family.pipeline.guidance_kwarg == "true_cfg_scale" and guidance > 1:
            negative = " "  # true CFG runs only with a negative prompt
        if negative is not None and "negative_prompt" in accepted:
            kwargs["negative_prompt"] = [negative] * len(chunk)
        if "." in family.pipeline.guidance_kwarg:  # held by a component (a guider), not passed to the call
            set_component_guidance(pipe, family.pipeline.guidance_kwarg, guidance)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted or k == "callback_on_step_end"}
        shape = call_shape(request, family.video_of(checkpoint), width, height, len(chunk))
        return self.registry.generate_kwargs(family, pipe, kwargs, shape)  # engine_generate_kwargs
