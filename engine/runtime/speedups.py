"""The plan's speed controls applied to a loaded pipeline, re-decided as it runs.

The speed half of :class:`~engine.runtime.session.InferenceSession`: the
attention backend (installed if the plan says, native SDPA when it cannot be
set), the regional compile (at load, or from the image the plan names so a
one-off image does not pay it) and the First-Block step cache, which is
re-decided for the actual step count of every generate call. Every departure
from the plan is recorded in it, with the reason, so ``status()`` shows what
ran rather than what was planned.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from engine.contract.plugins import Registry
from engine.policy.plan import Plan
from engine.requests.inference import InferenceRequest
from engine.policy.resolved import Resolved
from engine.policy.speed import resolve_step_cache, step_cache_offers, step_cache_unsupported
from engine.preflight.source import ModelSource
from engine.runtime import capabilities, quantize
from engine.runtime.attention import DIFFUSERS_BACKENDS, Installer, install_kernel
from engine.runtime.compile_cache import CompileCache
from engine.runtime.fusions import FusionReport, fuse


#: Step caches made anew for each call: MagCache's ratios are interpolated to the call's step
#: count, and SeaCache's trajectory would otherwise start a call from the last call's final step
#: (which it takes for a non-adjacent step, saying so on the log).
PER_CALL_CACHES = ("magcache", "seacache")


class SpeedControls:
    """Mixin of :class:`~engine.runtime.session.InferenceSession`: attention
    backend, regional compile and step cache on the loaded denoiser."""

    registry: Registry
    source: ModelSource
    plan: Plan
    request: InferenceRequest
    capabilities: dict[str, capabilities.CapabilityCheck] | None
    pipeline: Any
    denoiser: torch.nn.Module
    _installer: Installer
    _compile_backend: str
    #: The step cache engaged: ``off``, ``fbcache``, ``taylorseer``, ``magcache`` or ``seacache``.
    _cache_kind: str
    _active: Any

    @property
    def denoisers(self) -> list[torch.nn.Module]:
        """Every denoiser of the pipeline (a two-expert model's both): each optimisation goes to all.
        The session answers it from the family's ``denoiser`` and ``experts``."""
        raise NotImplementedError

    def _apply_attention(self) -> None:
        resolved = self.plan["attention_backend"]
        backend = str(resolved.value)
        outcome = install_kernel(self.plan, self._installer)  # a plan the router did not install for
        self.plan = dataclasses.replace(self.plan, attention_install=None)
        if outcome is not None:
            self._record("attention_backend", outcome)
            return
        if backend == "native":
            return
        try:
            for denoiser in self.denoisers:
                denoiser.set_attention_backend(DIFFUSERS_BACKENDS[backend])
        except (RuntimeError, ValueError, ImportError, OSError) as exc:  # OSError: a hub kernel not fetched
            self._record("attention_backend", Resolved(
                "native", resolved.source, f"{backend} could not be set ({exc}); native SDPA"
            ))

    #: What the eager fusions patched at load (None: the plan engaged none).
    fusions: FusionReport | None = None

    def _apply_fusions(self) -> None:
        """Fuse the blocks the family's table names, where the plan engages it; a block
        whose source changed stays as it is and the status says which and why."""
        self.fusions = None
        if not self.plan.value("eager_fusions"):
            return
        for denoiser in reversed(self.denoisers):  # the first denoiser's report is the one kept
            self.fusions = fuse(denoiser, self.source.family.speed.eager_fusions)
        if self.fusions is not None and not self.fusions.fused:
            why = "; ".join(f"{name}: {reason}" for name, reason in self.fusions.skipped.items())
            self._record("eager_fusions", Resolved(False, "auto", f"no block could be fused ({why})"))

    #: The exact prompt cache installed at load (None: the family names no sites, or compile runs).
    text_kv: Any = None

    def _apply_text_kv(self) -> None:
        """Memoise what the denoisers compute from the prompt alone (the family's
        ``text_kv_sites``): bit-identical, so on at every tier, but not under regional compile."""
        from engine.runtime.text_kv import install

        self.text_kv = None
        if self.plan.value("compile") != "regional":
            self.text_kv = install(self.denoisers, self.source.family.speed.text_kv_sites)

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
        self._compile_cache = CompileCache.for_model(self.source.location, {
            "family": self.source.family.name, "regions": sorted(regions), "dtype": self.plan.value("dtype"),
            "quant": self.plan.value("transformer_quant"), "fullgraph": self.plan.compile_fullgraph,
            "backend": self._compile_backend, "lora": self.plan.value("lora"),
        })
        if self._compile_cache is not None:
            self._compile_cache.restore()  # the compile below then hits the saved artifacts
        for module in (module for denoiser in self.denoisers for module in denoiser.modules()):
            if type(module).__name__ in regions:
                module.compile(
                    dynamic=True, fullgraph=self.plan.compile_fullgraph, backend=self._compile_backend
                )
        self._compiled = True

    _compile_cache: CompileCache | None = None

    def _store_compile_cache(self, width: int, height: int, count: int) -> None:
        """After a compiled generate: save the artifacts once per new image shape."""
        if self._compiled and self._compile_cache is not None:
            self._compile_cache.store(f"{width}x{height}x{count}")

    def compile_cache_status(self) -> dict[str, object] | None:
        """What the compile cache restored and stored this load (None: no compile or turned off)."""
        return dict(self._compile_cache.last) if self._compile_cache is not None else None

    # -- the step cache, re-decided per call ----------------------------------------

    def _call_pipeline(self) -> type:
        """The class of the pipeline this call runs (a workflow's own, else the loaded one)."""
        return type(self._active if self._active is not None else self.pipeline)

    def _cache_unsupported(self) -> str | None:
        """Why the loaded pipeline cannot carry the step cache, or None.

        The family's table lists the pipelines that open a cache context;
        where it does not say, the pipeline's call is read for one.
        """
        missing = capabilities.step_cache_unsupported(self.capabilities)
        if missing is not None:
            return missing
        family = self.source.family
        pipeline = self._call_pipeline()
        if family.pipeline.cache_context_pipelines is not None:
            return step_cache_unsupported(family.pipeline.cache_context_pipelines, pipeline.__name__)
        try:
            call = inspect.getsource(pipeline.__call__)
        except (OSError, TypeError):
            return None
        return None if "cache_context" in call else step_cache_unsupported((), pipeline.__name__)

    def _set_step_cache(self, kind: str, steps: int | None = None) -> str | None:
        """Engage the step cache ``kind`` (``fbcache``, ``taylorseer``, ``seacache``, ``magcache`` for a call of
        ``steps``) or release it (``off``); returns why it could not engage (and records it in the
        plan, with anything half-enabled rolled back)."""
        if kind == self._cache_kind and kind not in PER_CALL_CACHES:
            return None
        if self._cache_kind != "off":
            for denoiser in self.denoisers:
                denoiser.disable_cache()
            self._cache_kind = "off"
        if kind == "off":
            return None
        failure = self._cache_unsupported()
        if failure is None:
            try:  # every expert, or none: a half-cached pair is rolled back
                for denoiser in self.denoisers:
                    denoiser.enable_cache(self._cache_config(kind, steps))
            except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as exc:
                for denoiser in self.denoisers:
                    if getattr(denoiser, "is_cache_enabled", False):
                        denoiser.disable_cache()
                failure = f"enabling the {kind} step cache failed ({quantize.first_line(exc)}); rolled back"
        if failure is not None:
            was = self.plan["step_cache"]
            self._record("step_cache", Resolved("off", was.source, f"step cache unavailable: {failure}"))
            return failure
        self._cache_kind = kind
        return None

    def _cache_config(self, kind: str, steps: int | None = None) -> Any:
        """diffusers' config for the step cache ``kind`` (MagCache's for a call of ``steps``)."""
        if kind == "magcache":
            return self._magcache_config(steps or self.plan.default_steps)
        if kind == "seacache":
            from diffusers import SeaCacheConfig

            from engine.policy.speed import SEACACHE_MAX_SKIPS, SEACACHE_THRESHOLD

            return SeaCacheConfig(threshold=SEACACHE_THRESHOLD, max_consecutive_cached=SEACACHE_MAX_SKIPS)
        if kind == "taylorseer":
            from diffusers import TaylorSeerCacheConfig

            from engine.policy.speed import TAYLORSEER_INTERVAL, TAYLORSEER_WARMUP

            return TaylorSeerCacheConfig(cache_interval=TAYLORSEER_INTERVAL, disable_cache_before_step=TAYLORSEER_WARMUP,
                                         taylor_factors_dtype=None)
        from diffusers import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=self.plan.step_cache_threshold)

    def _magcache_config(self, steps: int) -> Any:
        import importlib

        from diffusers import MagCacheConfig

        from engine.policy.speed import MAGCACHE_MAX_SKIPS, MAGCACHE_RETENTION, MAGCACHE_THRESHOLD

        checkpoint = self.source.checkpoint
        where = checkpoint.mag_ratios if checkpoint is not None else None
        if where is None:
            raise ValueError("the checkpoint's table names no MagCache ratios")
        module, _, name = where.partition(":")
        ratios = getattr(importlib.import_module(module), name)
        return MagCacheConfig(threshold=MAGCACHE_THRESHOLD, max_skip_steps=MAGCACHE_MAX_SKIPS,
                              retention_ratio=MAGCACHE_RETENTION, num_inference_steps=steps, mag_ratios=ratios)

    def _recheck_step_cache(self, steps: int) -> None:
        plan = self.plan
        resolved, _ = resolve_step_cache(
            self.request.step_cache,
            steps,
            quantised=plan.value("transformer_quant") is not None or self.source.kind == "gguf",
            tier=str(plan.value("speed_tier")),
            denied=self.registry.optimization_deny(self.source.family),
            unsupported=self._cache_unsupported(),
            **step_cache_offers(self.source.family, self.source.checkpoint, self._call_pipeline().__name__),
        )
        if self._set_step_cache(str(resolved.value), steps) is None:
            self._record("step_cache", resolved)

    def _record(self, control: str, resolved: Resolved) -> None:
        self.plan = self.plan.with_control(control, resolved)
