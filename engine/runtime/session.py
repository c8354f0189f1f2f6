"""One loaded pipeline: load it as the plan says, generate, report, unload.

The plan's provenance follows what really happened: a quantised build that
fails, or any failure to place weights on the device (out of memory while
moving, quantising or installing offload hooks), releases what was placed and
loads the plan's fallback, with the reason recorded; an attention kernel that
cannot be installed falls back to native SDPA, and the step cache is
re-decided for the actual step count of every generate call. ``status()``
reports the record.

A torchao-quantised transformer is quantised on the way in (see
:func:`engine.runtime.quantize.quantize_on_host_then_place`): it is never
resident on the GPU in dense bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from engine.errors import EngineError
from engine.plugins import Registry
from engine.policy.compatibility import plan_refusals
from engine.runtime.canary import inference_canary
from engine.policy.inference import InferenceRequest, Plan
from engine.policy.resolved import Resolved, explicit
from engine.policy.speed import resolve_step_cache, step_cache_unsupported
from engine.preflight.lora import LoraFile
from engine.preflight.model import ModelSource
from engine.runtime import capabilities, flags, quantize
from engine.runtime import batching, text_encoders, workflows
from engine.runtime.vae import apply_vae_tiling
from engine.runtime.attention import DIFFUSERS_BACKENDS, Installer, pip_install_wheel
from engine.runtime.inputs import FittedInputs, ImageLike, fit_inputs, paste_unmasked, vae_dtype
from engine.runtime.whole_file import load_whole_file
from engine.runtime.lora import HookAdapters, LoraSet, check_on_pipeline
from engine.runtime.quantize import (
    Placement,
    PlacementFailed,
    QuantisationFailed,
    nf4_config,
    quantize_on_host_then_place,
)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Progress = Callable[[int, int], None]


class LoadFailed(EngineError):
    code = "load_failed"


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
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
    image: ImageLike | None = None
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


class InferenceSession:
    """A pipeline loaded per a :class:`Plan`. Not thread-safe for concurrent
    generates on one session: calls are serialised by a lock."""

    def __init__(
        self,
        registry: Registry,
        source: ModelSource,
        plan: Plan,
        request: InferenceRequest = InferenceRequest(),
        *,
        installer: Installer = pip_install_wheel,
        compile_backend: str = "inductor",
        loras: Sequence[LoraFile] = (),
        controlnet: str | None = None,
    ) -> None:
        self.registry = registry
        #: The ControlNet folder to load beside the pipeline, and the loaded model.
        self.controlnet_path = controlnet
        self._controlnet: Any = None
        self.source = source
        self.plan = plan
        self.request = request
        #: The numeric canary of the scheme loaded (see :mod:`engine.runtime.canary`), if one ran.
        self.canary: dict[str, object] | None = None
        self._installer = installer
        self._compile_backend = compile_backend
        self._pipe: Any = None
        self._flags: flags.FlagSnapshot | None = None
        self._cache_on = False
        self._lock = threading.Lock()
        self.quantised_layers = 0
        #: Streams the text encoders per call (``text_encoder_memory=streamed``).
        self.encoder_stream: text_encoders.EncoderStream | None = None
        self.encoder_placements: list[Placement] = []
        #: Whether the last call's VAE decoded in tiles.
        self.vae_tiled = False
        #: How the quantised transformer was placed, when one was.
        self.placement: Placement | None = None
        #: Why the planned fallback was loaded instead of the plan, if it was.
        self.fallback: dict[str, object] | None = None
        self._initial_loras = tuple(loras)
        #: The LoRAs applied to the pipeline (see :mod:`engine.runtime.lora`).
        self.loras: LoraSet | None = None
        #: Workflow pipelines built over the loaded components, by class name.
        self._workflow_pipes: dict[str, Any] = {}
        #: The pipeline the running generate calls (a workflow's), for the step cache.
        self._active: Any = None
        #: Out-of-memory splits of batch chunks since load (latest last).
        self.batch_events: list[dict[str, object]] = []
        #: What the loaded classes support, checked at load (declared vs verified).
        self.capabilities: dict[str, capabilities.CapabilityCheck] | None = None

    # -- load -------------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        if self._pipe is None:
            raise EngineError("no model is loaded", code="not_loaded")
        return self._pipe

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.source.family.denoiser)

    def load(self, progress: Progress | None = None) -> None:
        refused = plan_refusals(self.plan)
        if refused:  # a hand-built or stale plan: refuse before touching the device
            raise EngineError(
                f"this plan combines options that do not work together: {'; '.join(refused)}",
                code="incompatible_plan",
            )
        self._flags = flags.snapshot()
        try:
            self._apply_process_flags()
            self._pipe = self._build(self.plan, progress)
            family = self.source.family
            if self.controlnet_path:
                self._controlnet = workflows.load_controlnet(
                    family, self.controlnet_path, TORCH_DTYPES[str(self.plan.value("dtype"))],
                    self.plan.device if _resident(self.plan) else "cpu",
                )
            self.capabilities = capabilities.verify(family, self._pipe, self.registry.compile_regions(family))
            self.plan = capabilities.adapt_plan(self.plan, self.capabilities)
            self._apply_attention()
            self._apply_loras()
            self._apply_compile()
            self._set_step_cache(self.plan["step_cache"].value == "fbcache")
        except BaseException:
            self.unload()
            raise

    def _apply_process_flags(self) -> None:
        threads = self.plan.value("threads")
        if threads:
            torch.set_num_threads(int(threads))  # type: ignore[arg-type]
        if self.plan.device == "cuda" and "tf32" in self.plan.controls and self.plan.value("tf32"):
            torch.set_float32_matmul_precision("high")
        if self.plan.value("fp16_accumulation") and flags.fp16_accumulation_available():
            torch.backends.cuda.matmul.allow_fp16_accumulation = True

    def _build(self, plan: Plan, progress: Progress | None) -> Any:
        """Load and place per ``plan``; on any placement or quantisation
        failure, release what was placed and build the plan's fallback."""
        while True:
            try:
                return self._build_once(plan)
            except (PlacementFailed, QuantisationFailed) as exc:
                plan = self._fallback_after(plan, exc)

    def _build_once(self, plan: Plan) -> Any:
        dtype = TORCH_DTYPES[str(plan.value("dtype"))]
        scheme = plan.value("transformer_quant")
        pipe = self._load_pipeline(dtype, str(scheme) if scheme else None)
        self.quantised_layers, self.placement = 0, None
        if scheme and scheme != "nf4" and self.source.prequantised_scheme is None:
            denoiser = getattr(pipe, self.source.family.denoiser)
            self.placement = quantize_on_host_then_place(
                denoiser, str(scheme), plan.device, resident=_resident(plan),
                keep=quantize.module_filter(str(scheme), self.source.family.int8_dense_modules),
            )
            self.quantised_layers = self.placement.layers
            self.canary = inference_canary(
                denoiser, quantize.module_filter(str(scheme), self.source.family.int8_dense_modules),
                scheme=str(scheme), dtype=dtype,
            ).to_dict()  # a broken scheme raises CanaryFailed: the fallback is built instead
        elif dtype == torch.float16:  # fp16 compute: the dtype some families render black in
            self.canary = inference_canary(
                getattr(pipe, self.source.family.denoiser), lambda module, _: isinstance(module, torch.nn.Linear),
                scheme="fp16", dtype=dtype,
            ).to_dict()
        self.encoder_stream, self.encoder_placements, failure = text_encoders.prepare_encoders(
            pipe, getattr(pipe, self.source.family.denoiser), plan, self._root(), dtype, resident=_resident(plan),
        )
        if failure is not None:
            self.plan = plan = plan.with_control("text_encoder_quant", explicit("none", failure))
        self._apply_memory_mode(pipe, plan)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _fallback_after(self, plan: Plan, exc: PlacementFailed | QuantisationFailed) -> Plan:
        """The fallback plan to build after ``exc``, with the reason recorded;
        re-raise (with what to do) when the plan has none."""
        _release(exc)
        if plan.fallback is None:
            if isinstance(exc, PlacementFailed):
                raise PlacementFailed(
                    f"{exc.message}; free GPU memory (unload other models) or load with a "
                    "lighter --memory mode (model_offload, sequential_offload) or a --quant scheme",
                    out_of_memory=exc.out_of_memory,
                ) from None
            raise exc
        scheme = plan.value("transformer_quant")
        tried = f"the {scheme} build" if scheme else "the planned build"
        reason = f"{tried} failed: {exc.message}; loaded the fallback instead"
        self.fallback = {
            "code": exc.code,
            "reason": reason,
            "from": {"transformer_quant": scheme, "memory_mode": plan.value("memory_mode")},
        }
        fallback = plan.fallback.with_control("transformer_quant", explicit(None, reason))
        self.plan = fallback
        return fallback

    def _root(self) -> str:
        """The pipeline folder (or hub id) the non-denoiser components load from."""
        source = self.source
        return str(source.base if source.kind in ("single_file", "single_file_pipeline", "gguf") else source.location)

    def _load_pipeline(self, dtype: torch.dtype, scheme: str | None) -> Any:
        import diffusers

        source = self.source
        denoiser_name = source.family.denoiser
        from_file = source.kind == "single_file" or (source.kind == "gguf" and scheme is None)
        # A GGUF model with a torchao scheme is the dense-quant candidate: the
        # base's dense transformer is loaded and quantised instead of the file.
        root = source.base if source.kind in ("single_file", "gguf") else source.location
        try:
            if source.kind == "single_file_pipeline":  # every weight in one file: no base
                return load_whole_file(source, dtype)
            components: dict[str, Any] = {}
            if from_file or scheme == "nf4":
                config = diffusers.DiffusionPipeline.load_config(root)
                denoiser_cls = getattr(diffusers, config[denoiser_name][1])
            if from_file:
                extra: dict[str, Any] = {}
                if source.kind == "gguf":
                    extra["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
                components[denoiser_name] = denoiser_cls.from_single_file(
                    source.location, config=root, subfolder=denoiser_name, dtype=dtype, **extra
                )
            elif scheme == "nf4":
                components[denoiser_name] = denoiser_cls.from_pretrained(
                    root, subfolder=denoiser_name, dtype=dtype,
                    quantization_config=nf4_config(dtype),
                )
            if "text_encoder_quant" in self.plan.controls and self.plan.value("text_encoder_quant") == "nf4":
                components.update(text_encoders.nf4_encoder_components(
                    str(root), diffusers.DiffusionPipeline.load_config(root), dtype
                ))
            return diffusers.DiffusionPipeline.from_pretrained(root, dtype=dtype, **components)
        except torch.OutOfMemoryError as exc:  # nf4 loads onto the GPU as it quantises
            raise PlacementFailed(
                f"ran out of memory loading {source.location} ({quantize.first_line(exc)})",
                out_of_memory=True,
            ) from exc
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise LoadFailed(f"could not load {source.location} ({source.kind}): {exc}") from exc

    def _apply_memory_mode(self, pipe: Any, plan: Plan) -> None:
        """Place the pipeline per the memory mode; failures raise :class:`PlacementFailed`."""
        device = plan.device
        mode = plan.value("memory_mode")
        if _resident(plan) and self.encoder_stream is not None:
            for name, component in pipe.components.items():  # the encoders wait on the host
                if isinstance(component, torch.nn.Module) and name not in self.encoder_stream.names:
                    quantize.move_to(component, device, f"the {name}")
            return
        if _resident(plan):
            quantize.move_to(pipe, device, "the pipeline")
            return
        with quantize.placing(f"the pipeline ({mode})", device):
            if mode == "model_offload":
                pipe.enable_model_cpu_offload(device=device)
            elif mode == "sequential_offload":
                pipe.enable_sequential_cpu_offload(device=device)
            elif mode == "group_offload":
                pipe.enable_group_offload(
                    onload_device=torch.device(device),
                    offload_device=torch.device("cpu"),
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    use_stream=True,
                )

    def _apply_attention(self) -> None:
        resolved = self.plan["attention_backend"]
        backend = str(resolved.value)
        if self.plan.attention_install:
            if not self._installer(self.plan.attention_install):
                self._record("attention_backend", explicit(
                    "native", f"installing {self.plan.attention_install} failed; native SDPA"
                ))
                return
        if backend == "native":
            return
        try:
            self.denoiser.set_attention_backend(DIFFUSERS_BACKENDS[backend])
        except (RuntimeError, ValueError, ImportError, OSError) as exc:  # OSError: a hub kernel not fetched
            self._record("attention_backend", Resolved(
                "native", resolved.source, f"{backend} could not be set ({exc}); native SDPA"
            ))

    #: Generate calls since load, and whether the regional compile has run.
    _images = 0
    _compiled = False

    def _apply_compile(self, image: int = 1) -> None:
        """Compile the repeated blocks before image ``image`` of this load (1:
        at load, which also resets the count) once the plan's
        ``compile_from_image`` is reached: a dense model is compiled from the
        third image, so a one-off image does not pay the compile."""
        if image <= 1:
            self._images, self._compiled = 0, False
        if self._compiled or self.plan.value("compile") != "regional" or image < self.plan.compile_from_image:
            return
        regions = set(self.registry.compile_regions(self.source.family))
        for module in self.denoiser.modules():
            if type(module).__name__ in regions:
                module.compile(
                    dynamic=True, fullgraph=self.plan.compile_fullgraph, backend=self._compile_backend
                )
        self._compiled = True

    # -- the step cache, re-decided per call ----------------------------------------

    def _cache_unsupported(self) -> str | None:
        """Why the loaded pipeline cannot carry the step cache, or None.

        The family's table lists the pipelines that open a cache context;
        where it does not say, the pipeline's call is read for one.
        """
        missing = capabilities.step_cache_unsupported(self.capabilities)
        if missing is not None:
            return missing
        family = self.source.family
        pipeline = type(self._active if self._active is not None else self.pipeline)
        if family.cache_context_pipelines is not None:
            return step_cache_unsupported(family.cache_context_pipelines, pipeline.__name__)
        try:
            call = inspect.getsource(pipeline.__call__)
        except (OSError, TypeError):
            return None
        return None if "cache_context" in call else step_cache_unsupported((), pipeline.__name__)

    def _set_step_cache(self, on: bool) -> str | None:
        """Engage or release the cache; returns why it could not engage (and
        records it in the plan, with anything half-enabled rolled back)."""
        if on == self._cache_on:
            return None
        denoiser = self.denoiser
        if not on:
            denoiser.disable_cache()
            self._cache_on = False
            return None
        failure = self._cache_unsupported()
        if failure is None:
            from diffusers import FirstBlockCacheConfig

            try:
                denoiser.enable_cache(FirstBlockCacheConfig(threshold=self.plan.step_cache_threshold))
            except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as exc:
                if getattr(denoiser, "is_cache_enabled", False):
                    denoiser.disable_cache()
                failure = f"enabling First-Block-Cache failed ({quantize.first_line(exc)}); rolled back"
        if failure is not None:
            was = self.plan["step_cache"]
            self._record("step_cache", Resolved("off", was.source, f"step cache unavailable: {failure}"))
            return failure
        self._cache_on = True
        return None

    def _recheck_step_cache(self, steps: int) -> None:
        plan = self.plan
        resolved, _ = resolve_step_cache(
            self.request.step_cache,
            steps,
            quantised=plan.value("transformer_quant") is not None or self.source.kind == "gguf",
            tier=str(plan.value("speed_tier")),
            denied=self.registry.optimization_deny(self.source.family),
            unsupported=self._cache_unsupported(),
        )
        if self._set_step_cache(resolved.value == "fbcache") is None:
            self._record("step_cache", resolved)

    def _record(self, control: str, resolved: Resolved) -> None:
        self.plan = self.plan.with_control(control, resolved)

    # -- generate -------------------------------------------------------------

    def generate(self, request: GenerateRequest, progress: Progress | None = None) -> list[Image.Image]:
        """The request's images: its workflow's pipeline (built over the loaded
        components), its inputs fitted, one generator per image, in chunks
        (halved on out-of-memory; see :mod:`engine.runtime.batching`)."""
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
            pipe = workflows.workflow_pipeline(self.pipeline, class_name, self._workflow_pipes, extra)
            picture = workflows.control_input(request.control_image, request.control_preprocess) if control else request.image
            fitted = fit_inputs(
                picture, request.mask_image, width=request.width, height=request.height,
                multiple=family.side_multiple, dtype=vae_dtype(pipe),
            )
            steps = request.steps or self.plan.default_steps
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
            try:
                self._recheck_step_cache(effective)
                self._images += 1
                if self._images > 1:
                    self._apply_compile(self._images)
                images = self._run_batch(pipe, request, steps, effective, strength, fitted, items, progress)
            finally:
                self._active = None
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
            kwargs = self._call_kwargs(pipe, request, steps, chunk, fitted, strength)
            if progress is not None:
                before = done[0]

                def on_step(_pipe: Any, step: int, _t: Any, _kw: dict[str, Any]) -> dict[str, Any]:
                    done[0] = before + step + 1
                    progress(done[0], max(done[0], planned))
                    return {}

                kwargs["callback_on_step_end"] = on_step
            self.vae_tiled = apply_vae_tiling(pipe, self.plan, kwargs.get("width"), kwargs.get("height"))
            stream = self.encoder_stream
            if stream is not None:
                stream.before_call(pipe)
            try:
                with torch.inference_mode():
                    result = pipe(**kwargs)
            finally:
                if stream is not None:
                    stream.after_call()
            return list(result.images)

        def on_split(event: batching.SplitEvent) -> None:
            self.batch_events = [*self.batch_events[-19:], event.to_dict()]

        return batching.run_chunked(items, size, forward, on_split)

    def _call_kwargs(
        self, pipe: Any, request: GenerateRequest, steps: int, chunk: Sequence[batching.BatchItem],
        fitted: FittedInputs, strength: float | None,
    ) -> dict[str, Any]:
        family = self.source.family
        checkpoint = self.source.checkpoint or family.default_checkpoint
        guidance = checkpoint.default_guidance if request.guidance is None else request.guidance
        accepted = inspect.signature(pipe.__call__).parameters
        kwargs: dict[str, Any] = {
            "prompt": [item.prompt for item in chunk],
            "num_inference_steps": steps,
            "num_images_per_prompt": 1,
            "generator": batching.generators([item.seed for item in chunk]),
            family.guidance_kwarg: guidance,
        }
        width, height = (fitted.width, fitted.height) if fitted.image is not None else (request.width, request.height)
        if width:
            kwargs["width"] = width
        if height:
            kwargs["height"] = height
        if width and height:
            kwargs["max_area"] = width * height  # edit pipelines scale their output to this area
        if fitted.image is not None:
            kwargs["image"] = fitted.image
            kwargs["_auto_resize"] = False  # fitted already, to the requested box at the model's multiple
        if fitted.mask is not None:
            kwargs["mask_image"] = fitted.mask
        if strength is not None:
            kwargs["strength"] = strength
        if request.control_scale is not None:
            kwargs["controlnet_conditioning_scale"] = request.control_scale
        negative = request.negative_prompt
        if negative is None and family.guidance_kwarg == "true_cfg_scale" and guidance > 1:
            negative = " "  # true CFG runs only with a negative prompt
        if negative is not None and "negative_prompt" in accepted:
            kwargs["negative_prompt"] = [negative] * len(chunk)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted or k == "callback_on_step_end"}
        return self.registry.generate_kwargs(family, pipe, kwargs)  # engine_generate_kwargs

    # -- status and unload ----------------------------------------------------

    def status(self) -> dict[str, object]:
        return {
            "loaded": self._pipe is not None,
            "model": self.source.to_dict(),
            "plan": self.plan.to_dict(),
            "step_cache_engaged": self._cache_on,
            "quantised_layers": self.quantised_layers,
            "text_encoders": {
                "placements": [p.to_dict() for p in self.encoder_placements],
                "stream": self.encoder_stream.status() if self.encoder_stream else None,
                "vae_tiled_last_call": self.vae_tiled,
            },
            "placement": self.placement.to_dict() if self.placement else None,
            "fallback": self.fallback,
            "canary": self.canary,
            "loras": self.loras.status() if self.loras is not None else None,
            "workflows": sorted({"txt2img", *self.source.family.workflows_of(self.source.checkpoint)}),
            "controlnet": self.controlnet_path,
            "batch_events": list(self.batch_events),
            "capabilities": capabilities.to_dict(self.capabilities) if self.capabilities else None,
        }

    # -- LoRAs ------------------------------------------------------------------

    def _apply_loras(self) -> None:
        """Apply the LoRAs given at construction as the plan's ``lora`` control
        says (before compile, so hot-swap slots are declared first)."""
        mode = str(self.plan.value("lora")) if "lora" in self.plan.controls else "unfused"
        ranks = self.request.loras.max_rank or max((f.rank for f in self._initial_loras), default=0)
        hooks = None
        if self.capabilities is not None and not self.capabilities["pipeline_lora"].verified:
            hooks = HookAdapters(self.registry, self.source.family, self._pipe)
        self.loras = LoraSet(self._pipe, "unfused" if mode == "none" else mode, ranks, hooks)
        self.loras.prepare_hotswap()
        if self._initial_loras:
            check_on_pipeline(self.registry, self.source.family, self._pipe, self._initial_loras)
            self.loras.apply(self._initial_loras)

    def set_loras(self, files: Sequence[LoraFile]) -> None:
        """Switch the LoRAs or their scales on the loaded pipeline (the base is
        not reloaded); every file is checked before anything changes."""
        if self.loras is None:
            raise EngineError("no model is loaded", code="not_loaded")
        files = tuple(files)
        if files != self.loras.applied:
            check_on_pipeline(self.registry, self.source.family, self.pipeline, files)
            self.loras.apply(files)

    def unload(self) -> None:
        """Release the pipeline and memory, and restore every torch flag."""
        self._pipe = None
        self.encoder_stream = None
        self._workflow_pipes.clear()
        self._controlnet = None
        self.loras = None
        self._cache_on = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._flags is not None:
            self._flags.restore()
            self._flags = None


def _resident(plan: Plan) -> bool:
    """Whether the whole pipeline lives on the plan's device (no offload hooks)."""
    return plan.device == "cpu" or plan.value("memory_mode") == "resident"


def _release(exc: BaseException) -> None:
    """Drop the frames a failed build's traceback holds, so the half-placed
    pipeline they reference is freed before the fallback loads."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
