"""One loaded pipeline: load it as the plan says, generate, report, unload.

The plan's provenance follows what really happened: a quantised build that
fails falls back to the plan's fallback, an attention kernel that cannot be
installed falls back to native SDPA, and the step cache is re-decided for the
actual step count of every generate call. ``status()`` reports the record.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from engine.errors import EngineError
from engine.plugins import Registry
from engine.policy.inference import InferenceRequest, Plan
from engine.policy.resolved import Resolved, explicit
from engine.policy.speed import resolve_step_cache
from engine.preflight.model import ModelSource
from engine.runtime import flags
from engine.runtime.attention import DIFFUSERS_BACKENDS, Installer, pip_install_wheel
from engine.runtime.quantize import QuantisationFailed, nf4_config, quantize_transformer

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
    ) -> None:
        self.registry = registry
        self.source = source
        self.plan = plan
        self.request = request
        self._installer = installer
        self._compile_backend = compile_backend
        self._pipe: Any = None
        self._flags: flags.FlagSnapshot | None = None
        self._cache_on = False
        self._lock = threading.Lock()
        self.quantised_layers = 0

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
        self._flags = flags.snapshot()
        try:
            self._apply_process_flags()
            self._pipe = self._build(self.plan, progress)
            self._apply_attention()
            self._apply_compile()
            self._set_step_cache(self.plan["step_cache"].value == "fbcache")
        except BaseException:
            self.unload()
            raise

    def _apply_process_flags(self) -> None:
        threads = self.plan.value("threads")
        if threads:
            torch.set_num_threads(int(threads))  # type: ignore[arg-type]
        if self.plan.device == "cuda":
            torch.set_float32_matmul_precision("high")
        if self.plan.value("fp16_accumulation") and flags.fp16_accumulation_available():
            torch.backends.cuda.matmul.allow_fp16_accumulation = True

    def _build(self, plan: Plan, progress: Progress | None) -> Any:
        dtype = TORCH_DTYPES[str(plan.value("dtype"))]
        scheme = plan.value("transformer_quant")
        pipe = self._load_pipeline(dtype, str(scheme) if scheme else None)
        device = plan.device
        if scheme and scheme != "nf4" and self.source.prequantised_scheme is None:
            denoiser = getattr(pipe, self.source.family.denoiser)
            denoiser.to(device)
            try:
                self.quantised_layers = quantize_transformer(denoiser, str(scheme), device)
            except QuantisationFailed as exc:
                if plan.fallback is None:
                    raise
                del pipe, denoiser
                gc.collect()
                fallback = plan.fallback.with_control(
                    "transformer_quant",
                    explicit(None, f"{exc.message}; loaded the fallback instead"),
                )
                self.plan = fallback
                return self._build(fallback, progress)
        self._apply_memory_mode(pipe, plan)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _load_pipeline(self, dtype: torch.dtype, scheme: str | None) -> Any:
        import diffusers

        source = self.source
        denoiser_name = source.family.denoiser
        from_file = source.kind == "single_file" or (source.kind == "gguf" and scheme is None)
        # A GGUF model with a torchao scheme is the dense-quant candidate: the
        # base's dense transformer is loaded and quantised instead of the file.
        root = source.base if source.kind in ("single_file", "gguf") else source.location
        try:
            config = diffusers.DiffusionPipeline.load_config(root)
            denoiser_cls = getattr(diffusers, config[denoiser_name][1])
            components: dict[str, Any] = {}
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
            return diffusers.DiffusionPipeline.from_pretrained(root, dtype=dtype, **components)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise LoadFailed(f"could not load {source.location} ({source.kind}): {exc}") from exc

    def _apply_memory_mode(self, pipe: Any, plan: Plan) -> None:
        device = plan.device
        mode = plan.value("memory_mode")
        if device == "cpu" or mode == "resident":
            pipe.to(device)
        elif mode == "model_offload":
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
        except (RuntimeError, ValueError, ImportError) as exc:
            self._record("attention_backend", Resolved(
                "native", resolved.source, f"{backend} could not be set ({exc}); native SDPA"
            ))

    def _apply_compile(self) -> None:
        if self.plan.value("compile") != "regional":
            return
        regions = set(self.registry.compile_regions(self.source.family))
        for module in self.denoiser.modules():
            if type(module).__name__ in regions:
                module.compile(
                    dynamic=True, fullgraph=self.plan.compile_fullgraph, backend=self._compile_backend
                )

    # -- the step cache, re-decided per call ----------------------------------------

    def _set_step_cache(self, on: bool) -> None:
        if on == self._cache_on:
            return
        denoiser = self.denoiser
        if on:
            from diffusers import FirstBlockCacheConfig

            denoiser.enable_cache(FirstBlockCacheConfig(threshold=self.plan.step_cache_threshold))
        else:
            denoiser.disable_cache()
        self._cache_on = on

    def _recheck_step_cache(self, steps: int) -> None:
        plan = self.plan
        resolved, _ = resolve_step_cache(
            self.request.step_cache,
            steps,
            quantised=plan.value("transformer_quant") is not None or self.source.kind == "gguf",
            tier=str(plan.value("speed_tier")),
            denied=self.registry.optimization_deny(self.source.family),
        )
        self._set_step_cache(resolved.value == "fbcache")
        self._record("step_cache", resolved)

    def _record(self, control: str, resolved: Resolved) -> None:
        self.plan = self.plan.with_control(control, resolved)

    # -- generate -------------------------------------------------------------

    def generate(self, request: GenerateRequest, progress: Progress | None = None) -> list[Image.Image]:
        with self._lock:
            pipe = self.pipeline
            steps = request.steps or self.plan.default_steps
            self._recheck_step_cache(steps)
            kwargs = self._call_kwargs(pipe, request, steps)
            if progress is not None:
                def on_step(_pipe: Any, step: int, _t: Any, _kw: dict[str, Any]) -> dict[str, Any]:
                    progress(step + 1, steps)
                    return {}

                kwargs["callback_on_step_end"] = on_step
            with torch.inference_mode():
                result = pipe(**kwargs)
            return list(result.images)

    def _call_kwargs(self, pipe: Any, request: GenerateRequest, steps: int) -> dict[str, Any]:
        family = self.source.family
        checkpoint = self.source.checkpoint or family.default_checkpoint
        guidance = checkpoint.default_guidance if request.guidance is None else request.guidance
        accepted = inspect.signature(pipe.__call__).parameters
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "num_inference_steps": steps,
            "num_images_per_prompt": request.count,
            "generator": torch.Generator("cpu").manual_seed(request.seed),
            family.guidance_kwarg: guidance,
        }
        if request.width:
            kwargs["width"] = request.width
        if request.height:
            kwargs["height"] = request.height
        negative = request.negative_prompt
        if negative is None and family.guidance_kwarg == "true_cfg_scale" and guidance > 1:
            negative = " "  # true CFG runs only with a negative prompt
        if negative is not None and "negative_prompt" in accepted:
            kwargs["negative_prompt"] = negative
        return {k: v for k, v in kwargs.items() if k in accepted or k == "callback_on_step_end"}

    # -- status and unload ----------------------------------------------------

    def status(self) -> dict[str, object]:
        return {
            "loaded": self._pipe is not None,
            "model": self.source.to_dict(),
            "plan": self.plan.to_dict(),
            "step_cache_engaged": self._cache_on,
            "quantised_layers": self.quantised_layers,
        }

    def unload(self) -> None:
        """Release the pipeline and memory, and restore every torch flag."""
        self._pipe = None
        self._cache_on = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._flags is not None:
            self._flags.restore()
            self._flags = None
