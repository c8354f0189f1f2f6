"""The torch (diffusers) half of a plan: one planner object per machine.

:func:`engine.policy.inference.plan_inference` decides the ``engine`` control
and then asks a :class:`TorchPlanner` for the rest. The planner is built from
the facts of one load on one machine; every value it derives is set in
``__init__`` (before any method reads it), and :meth:`TorchPlanner.plan`
runs the steps in the order their refusals are reported: the compute dtype,
the transformer scheme and its memory plan, the text encoders' placement,
then the speed controls and the record (the fallback's record first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from engine.contract.plugins import Registry
from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.activations import (
    CONTEXT_GB,
    guarded_overhead_gb,
    resolve_vae_slicing,
    resolve_vae_tiling,
)
from engine.policy.attention import resolve_attention
from engine.policy.available import AvailableMemory
from engine.policy.compatibility import plan_refusals
from engine.policy.component_dtypes import component_dtype, weight_factor
from engine.policy.cpu_kernel import resolve_cpu_kernel
from engine.policy.dtype import DTYPE_FACTOR, resolve_dtype
from engine.policy.encoders import (
    encoder_gb_as_planned,
    movable_encoder_quant,
    resolve_text_encoder_memory,
    resolve_text_encoder_quant,
)
from engine.policy.lora import resolve_lora
from engine.policy.memory import Components, MemoryThresholds, plan_memory
from engine.policy.plan import ModelFacts, Plan, requested_by_control
from engine.policy.quant import lift_denials, lifted_denials, resolve_quant_request
from engine.policy.resolved import Resolved, auto, explicit, with_requests
from engine.policy.scheme_choice import MemoryPlan, choose_transformer_scheme
from engine.policy.stored_formats import kept_as_stored, stored_choice
from engine.policy.schemes import HOST_QUANTISED, transformer_gb
from engine.policy.speed import (
    StepCacheThresholds,
    resolve_compile,
    resolve_eager_fusions,
    resolve_fp16_accumulation,
    resolve_speed_tier,
    resolve_step_cache,
    resolve_tf32,
    resolve_threads,
    schedule_compile,
    step_cache_offers,
    step_cache_unsupported,
)
from engine.requests.inference import InferenceRequest
from engine.policy.request_shape import own_size, request_shape

#: Steps assumed when neither the request nor a known checkpoint says.
FALLBACK_STEPS = 28

_T = TypeVar("_T")


def checked(resolver: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Call ``resolver``, turning its ValueError (a bad request value) into a refusal."""
    try:
        return resolver(*args, **kwargs)
    except ValueError as exc:
        raise PreflightError(str(exc), code="invalid_request") from None


@dataclass(frozen=True)
class SpeedControls:
    """The speed controls of one plan (or its fallback), resolved together
    because each reads the tier and the step cache reads the compile."""

    tier: Resolved[str]
    step_cache: Resolved[str]
    threshold: float
    cache_may_engage: bool
    compile: Resolved[str]
    fullgraph: bool
    compile_from_image: int
    attention: Resolved[str]
    attention_install: str | None


class TorchPlanner:
    """Plans the diffusers controls of one load on one machine, ``engine`` decided."""

    def __init__(
        self, registry: Registry, model: ModelFacts, hardware: HardwareProfile, available: AvailableMemory, *,
        request: InferenceRequest, env: Mapping[str, str], engine: Resolved[str],
        memory_thresholds: MemoryThresholds, cache_thresholds: StepCacheThresholds,
    ) -> None:
        self.registry, self.model, self.hardware, self.available = registry, model, hardware, available
        self.request, self.env, self.engine = request, env, engine
        self.memory_thresholds, self.cache_thresholds = memory_thresholds, cache_thresholds
        self.family = family = model.family
        self.deny_reasons = registry.quant_deny_reasons(family, "inference")
        self.quant_denied = lift_denials(self.deny_reasons, family, hardware)
        self.denied = registry.optimization_deny(family)
        self.encoder_quant: Resolved[str] = checked(
            resolve_text_encoder_quant, family, hardware, request.text_encoder_quant,
            encoders_gb=model.sizes.text_encoders_gb, precast=model.precast_encoders,
        )
        self.shape = request_shape(family, model.checkpoint, request, own_size(model.defaults), model.defaults.frames)
        #: The scheme and name of the transformer as given (the fallback's).
        self.base_quant = model.prequantised_scheme
        self.base_name = "GGUF" if model.gguf_transformer_gb is not None else "dense"
        checkpoint = model.checkpoint
        pipeline_class = family.pipeline_class_of(checkpoint) if checkpoint else None
        self.cache_unsupported = step_cache_unsupported(family.pipeline.cache_context_pipelines, pipeline_class)
        self.cache_offers = step_cache_offers(family, checkpoint, pipeline_class)
        self.requested = requested_by_control(request)
        #: On a CPU the weights stay in RAM whatever the memory mode says.
        self.cpu = hardware.vendor == "cpu"

    # -- sizes and memory -------------------------------------------------------

    def thresholds(self, dtype: str) -> MemoryThresholds:
        """The memory knobs with the overhead guarded for the image shape in ``dtype``."""
        overhead, _ = guarded_overhead_gb(
            self.family, self.shape, 2 * DTYPE_FACTOR[dtype], self.memory_thresholds.overhead_gb,
            self.model.checkpoint,
        )
        return dataclasses.replace(self.memory_thresholds, overhead_gb=overhead,
                                   base_overhead_gb=self.memory_thresholds.overhead_gb)

    def transformer_gb(self, dtype: str, scheme: str | None) -> tuple[float, float]:
        """The denoiser's steady and transient GB in ``dtype`` and ``scheme``, its LoRAs included."""
        model, factor = self.model, DTYPE_FACTOR[dtype]
        if scheme is not None:
            steady, transient = transformer_gb(
                model.sizes.transformer_gb, scheme, prequantised=scheme == model.prequantised_scheme,
                factor=self.family.quantisation.factor(scheme, inference=True),
            )
            if model.measured_scheme_gb and scheme in model.measured_scheme_gb:
                steady = model.measured_scheme_gb[scheme]
            if scheme in HOST_QUANTISED:
                # torchao schemes are quantised on the host and moved quantised:
                # the device never holds the dense transformer.
                transient = steady
        elif model.gguf_transformer_gb is not None:
            steady = transient = model.gguf_transformer_gb
        else:
            steady = transient = model.sizes.transformer_gb * factor
        lora_gb = self.request.loras.params * 2 * factor / 1e9  # adapters sit beside the denoiser
        return steady + lora_gb, transient + lora_gb

    def components(self, dtype: str, scheme: str | None) -> Components:
        """GB of each part in ``dtype`` with the transformer in ``scheme``."""
        factor, sizes = DTYPE_FACTOR[dtype], self.model.sizes
        steady, transient = self.transformer_gb(dtype, scheme)

        def width(component: str) -> float:
            return weight_factor(self.family, self.hardware, dtype, component)

        return Components(
            transformer_gb=steady,
            transformer_transient_gb=transient,
            text_encoders_gb=encoder_gb_as_planned(
                sizes.text_encoders_gb, str(self.encoder_quant.value), width("text_encoders"),
                self.model.precast_encoders,
            ),
            vae_gb=sizes.vae_gb * width("vae"),
            quantised=scheme is not None and scheme != "nf4",
            controlnet_gb=self.model.controlnet_gb * factor,
            denoiser_label=self.family.pipeline.denoiser_label,
        )

    def memory(self, dtype: str, scheme: str | None, requested: str | None = None) -> MemoryPlan | None:
        """The memory plan for ``requested`` (default: the request's), None where ``auto`` fits nothing."""
        requested = self.request.memory if requested is None else requested
        try:
            return plan_memory(self.components(dtype, scheme), self.hardware, requested, self.thresholds(dtype))
        except PreflightError:
            if requested != "auto":
                raise
            return None

    def memory_apart(self, dtype: str) -> MemoryPlan | None:
        """The ``auto`` memory plan of the denoiser and VAE alone (the text encoders placed apart)."""
        try:
            return plan_memory(dataclasses.replace(self.components(dtype, None), text_encoders_gb=0.0),
                               self.hardware, "auto", self.thresholds(dtype))
        except PreflightError:
            return None

    # -- the steps ---------------------------------------------------------------

    def plan(self) -> Plan:
        """Every torch control resolved, with the fallback's plan where a scheme was taken."""
        dtype = self.dtype()
        quant = checked(
            resolve_quant_request, self.request.quant, self.hardware, self.quant_denied,
            family_label=self.family.label, dtype=dtype.value,
            lifted=lifted_denials(self.deny_reasons, self.family, self.hardware),
        )
        self.base_quant, quant = stored_choice(self.model, self.base_quant, quant, self.hardware, dtype.value, self.family)
        choice = choose_transformer_scheme(
            quant, prequantised=self.base_quant, base=self.memory(dtype.value, self.base_quant),
            base_name=self.base_name, tier=self.request.speed,
            memory_for=lambda scheme: self.memory(dtype.value, scheme), label=self.family.pipeline.denoiser_label,
        )
        choice = kept_as_stored(choice, self.model.stored_format, self.base_quant, self.hardware, dtype.value)  # a publisher's fp8 file, kept
        if choice.memory is None:
            raise self.does_not_fit(dtype.value)
        encoder_memory, chosen = self.encoders_memory(dtype.value, choice.quant.value, choice.memory)
        fallback = None
        if choice.fallback_memory is not None:
            fallback_encoders, fallback_memory = self.encoders_memory(
                dtype.value, self.base_quant, choice.fallback_memory
            )
            reason = f"fallback: the {self.base_name} transformer, if the {choice.quant.value} build fails"
            fallback = self.assemble(dtype, explicit(None, reason), fallback_memory, fallback_encoders, None)
        return self.assemble(dtype, choice.quant, chosen, encoder_memory, fallback)

    def dtype(self) -> Resolved[str]:
        """The compute dtype; fp32 is weighed by whether it fits without streaming: the whole
        model, or its denoiser and VAE with the text encoders placed on their own (they run once
        per prompt, so a 22.8 GB fp32 encoder beside a 5.7 GB fp32 denoiser does not decide a GPU's)."""
        apart = self.memory_apart("fp32") if self.hardware.cuda else None  # on a CPU they share one RAM
        fp32_fits = any(plan is not None and plan[0].value in ("resident", "model_offload")
                        for plan in (self.memory("fp32", None, "auto"), apart))
        return resolve_dtype(self.family, self.hardware, self.request.dtype, fp32_fits=fp32_fits, exact=self.request.speed == "off")

    def does_not_fit(self, dtype: str) -> PreflightError:
        """The refusal for a model no plan fits, in the memory rule's own words."""
        try:  # unified memory, RAM and swap, ...
            plan_memory(self.components(dtype, self.base_quant), self.hardware, "auto", self.thresholds(dtype))
            detail = ""
        except PreflightError as exc:
            detail = f": {exc.message}"
        hardware = self.hardware
        return PreflightError(
            f"{self.family.label} does not fit this machine ({hardware.device_name}, "
            f"{hardware.total_memory_gb:.1f} GB) in any plan{detail}",
            code="insufficient_memory",
        )

    def encoders_memory(
        self, dtype: str, scheme: str | None, memory: MemoryPlan
    ) -> tuple[Resolved[str], MemoryPlan]:
        """Where the text encoders live, and the memory plan that placement leaves."""
        mode = memory[0]
        fell_back = mode.source != "auto" and mode.overridden
        if mode.source != "auto" and self.request.text_encoder_memory == "auto" and not fell_back:
            return auto("resident", "the memory mode was set explicitly: the encoders follow it"), memory
        if fell_back and self.request.text_encoder_memory == "auto":
            # An explicit mode that does not fit falls to the next tier that does, as auto ranks
            # them: streamed encoders beside a resident denoiser rank ahead of model offload.
            encoders, (settled, estimate) = checked(
                resolve_text_encoder_memory, self.components(dtype, scheme), (auto(mode.value, mode.reason), memory[1]),
                self.hardware, "auto", self.thresholds(dtype),
            )
            if encoders.value == "streamed":
                refused, _, _ = mode.reason.partition("; next that does")
                mode = dataclasses.replace(  # fell back even where the denoiser is resident: the encoders are not
                    mode, value=settled.value, status="fell back",
                    reason=f"{refused}; next that does: {settled.value}, the text encoders streamed per prompt",
                )
            return encoders, (mode, estimate)
        return checked(
            resolve_text_encoder_memory, self.components(dtype, scheme), memory, self.hardware,
            self.request.text_encoder_memory, self.thresholds(dtype),
        )

    def vae_tiling(self, dtype: str, memory: MemoryPlan) -> Resolved[int | None]:
        """VAE tiling from the headroom left at decode, once the weights are in."""
        estimate = memory[1]
        weights_at_decode = estimate.peak_gb - estimate.overhead_gb
        if self.cpu:
            headroom = estimate.budget_gb + (self.hardware.swap_free_gb or 0.0) - weights_at_decode
        else:
            headroom = (self.thresholds(dtype).resident_fraction * estimate.budget_gb
                        - weights_at_decode - CONTEXT_GB)
        return checked(resolve_vae_tiling, self.family, headroom, 2 * DTYPE_FACTOR[dtype], self.request.vae_tiling)

    def speed(self, dtype: str, scheme: str | None, memory_mode: str) -> SpeedControls:
        """The tier, step cache, compile and attention of a plan with ``scheme``."""
        request, model = self.request, self.model
        gguf = scheme is None and model.gguf_transformer_gb is not None
        quantised = scheme is not None or model.gguf_transformer_gb is not None
        tier = resolve_speed_tier(request.speed, quantised=quantised, label=self.family.pipeline.denoiser_label)
        cache, threshold = checked(
            resolve_step_cache, request.step_cache, self.steps,
            quantised=quantised, tier=tier.value, denied=self.denied, thresholds=self.cache_thresholds,
            unsupported=self.cache_unsupported, **self.cache_offers,
        )
        cache_may_engage = cache.value != "off" or (
            request.step_cache == "auto" and "step_cache" not in self.denied and tier.value != "off"
            and self.cache_unsupported is None
        )
        compiled, fullgraph = checked(
            resolve_compile, request.compile, self.hardware, tier=tier.value,
            regions=self.registry.compile_regions(self.family), denied=self.denied, gguf=gguf,
            cache_may_engage=cache_may_engage, memory="resident" if self.cpu else memory_mode,
            dtype=dtype, env=self.env,
        )
        compiled, from_image = schedule_compile(compiled, quantised=scheme is not None and scheme != "nf4")
        attention, install = checked(
            resolve_attention, request.attention, self.hardware, self.denied, self.env, dtype=dtype, tier=tier.value
        )
        return SpeedControls(tier, cache, threshold, cache_may_engage, compiled, fullgraph, from_image,
                             attention, install)

    @property
    def steps(self) -> int:
        """Steps per image: the request's, the checkpoint's default, or :data:`FALLBACK_STEPS`."""
        checkpoint, own, lora = self.model.checkpoint, self.model.defaults.steps, self.request.loras.sampling
        return self.request.steps or (lora.steps if lora else None) or own or (checkpoint.default_steps if checkpoint else FALLBACK_STEPS)

    def controls(
        self, dtype: Resolved[str], scheme: Resolved[str | None], memory: MemoryPlan,
        encoder_memory: Resolved[str], vae_tiling: Resolved[int | None], speed: SpeedControls,
    ) -> dict[str, Resolved[Any]]:
        """Every control of the plan by its name, each with the request it answers."""
        hardware, tier, family = self.hardware, speed.tier.value, self.family
        placed = "resident" if self.cpu else memory[0].value
        gguf_name = "GGUF" if self.model.gguf_transformer_gb is not None else None
        controls: dict[str, Resolved[Any]] = {
            "engine": self.engine,
            "dtype": dtype,
            "transformer_quant": scheme,
            "text_encoder_dtype": component_dtype(family, hardware, dtype, "text_encoders"),
            "vae_dtype": component_dtype(family, hardware, dtype, "vae"),
            "memory_mode": memory[0],
            "attention_backend": speed.attention,
            "step_cache": speed.step_cache,
            "compile": speed.compile,
            "speed_tier": speed.tier,
            "fp16_accumulation": resolve_fp16_accumulation(
                hardware, dtype=dtype.value, tier=tier, denied=self.denied, env=self.env
            ),
            # sd.cpp computes on its CPU backend whatever the accelerator: its threads are the CPU's
            "threads": resolve_threads(
                hardware.replace(vendor="cpu") if self.engine.value == "sdcpp" else hardware, self.request.threads,
                env=self.env, denoiser_gb=None if self.engine.value == "sdcpp" else self.model.sizes.transformer_gb,
            ),
            "cpu_kernel": resolve_cpu_kernel(hardware, dtype=dtype.value, engine=self.engine.value, tier=tier),
            "lora": resolve_lora(
                self.request.loras, quantised=scheme.value or gguf_name, compiled=speed.compile.value == "regional",
                dtype=dtype.value),
            "tf32": resolve_tf32(hardware, tier=tier),
            "text_encoder_quant": movable_encoder_quant(
                self.encoder_quant, placed, str(encoder_memory.value), hardware
            ),
            "text_encoder_memory": encoder_memory,
            "vae_tiling": vae_tiling,
            "vae_slicing": resolve_vae_slicing(family),
            "eager_fusions": resolve_eager_fusions(len(family.speed.eager_fusions), tier=tier, env=self.env),
        }
        return with_requests(controls, self.requested)

    def assemble(
        self, dtype: Resolved[str], scheme: Resolved[str | None], memory: MemoryPlan,
        encoder_memory: Resolved[str], fallback: Plan | None,
    ) -> Plan:
        """The plan record; refused where the compatibility table refuses its combination."""
        model, hardware = self.model, self.hardware
        vae_tiling = self.vae_tiling(dtype.value, memory)
        speed = self.speed(dtype.value, scheme.value, memory[0].value)
        sizes = {"table": model.table_sizes}
        if model.measured_sizes:
            sizes["measured"] = model.measured_sizes
        planned = Plan(
            family=self.family.name,
            checkpoint=model.checkpoint.name if model.checkpoint else None,
            device="cuda" if hardware.cuda else hardware.vendor,
            controls=MappingProxyType(self.controls(dtype, scheme, memory, encoder_memory, vae_tiling, speed)),
            estimate=memory[1],
            step_cache_threshold=speed.threshold,
            compile_fullgraph=speed.fullgraph,
            attention_install=speed.attention_install,
            default_steps=self.steps, lora_sampling=self.request.loras.sampling, lora_modules=self.request.loras.modules,
            fallback=fallback,
            default_size=own_size(model.defaults),
            sizes=MappingProxyType(sizes),
            available=self.available,
            compile_from_image=speed.compile_from_image,
            gguf=scheme.value is None and model.gguf_transformer_gb is not None,
            step_cache_may_engage=speed.cache_may_engage,
            denoiser_label=self.family.pipeline.denoiser_label,
            sdcpp=model.sdcpp if self.engine.value == "sdcpp" else None,
        )
        refused = plan_refusals(planned)
        if refused:  # a resolver let through what the compatibility table refuses
            raise PreflightError(
                f"the plan combines options that do not work together: {'; '.join(refused)}",
                code="incompatible_plan",
            )
        return planned
