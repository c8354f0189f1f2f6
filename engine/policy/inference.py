"""The inference plan: every control resolved with its reason, before loading.

``plan_inference`` is pure and torch-free. It decides the compute dtype, the
transformer scheme, the memory mode and the speed controls for one model on
one machine, and returns a :class:`Plan`: a record of :class:`Resolved`
values keyed by the control names UIs and the HTTP API use.

The quantised plan carries a ``fallback``: the plan for the transformer as
given (dense, or the GGUF file). The runtime adopts the quantised plan only
when the quantised build succeeds, else it loads the fallback with the
fallback's own memory plan.

The records it reads and returns live in :mod:`engine.policy.plan`, and the
per-control resolvers in the policy modules it imports (the transformer
scheme in :mod:`engine.policy.scheme_choice`, the memory mode in
:mod:`engine.policy.memory`, the speed controls in :mod:`engine.policy.speed`,
the LoRA mode in :mod:`engine.policy.lora`, ...); this module sizes the
components and assembles the resolved controls into a plan and its fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry
from engine.policy.available import AvailableMemory, available_memory
from engine.policy.compatibility import plan_refusals
from engine.policy.activations import (
    CONTEXT_GB,
    DEFAULT_SIDE_PX,
    ImageShape,
    guarded_overhead_gb,
    resolve_vae_slicing,
    resolve_vae_tiling,
)
from engine.policy.dtype import DTYPE_FACTOR, resolve_dtype
from engine.policy.encoders import (
    encoder_gb_as_planned,
    movable_encoder_quant,
    resolve_text_encoder_memory,
    resolve_text_encoder_quant,
)
from engine.policy.lora import resolve_lora
from engine.requests.inference import LoraPlanInput
from engine.policy.memory import (
    Components,
    MemoryEstimate,
    MemoryThresholds,
    plan_memory,
)
from engine.policy.plan import CONTROLS, ModelFacts, Plan, requested_by_control
from engine.requests.inference import InferenceRequest
from engine.policy.quant import lift_denials, lifted_denials, resolve_quant_request
from engine.policy.runtime_engine import resolve_engine, torch_is_faster
from engine.policy.resolved import Resolved, auto, explicit, with_requests
from engine.policy.scheme_choice import choose_transformer_scheme
from engine.policy.schemes import HOST_QUANTISED, transformer_gb
from engine.policy.speed import (
    StepCacheThresholds,
    resolve_attention,
    resolve_compile,
    resolve_fp16_accumulation,
    resolve_eager_fusions,
    resolve_speed_tier,
    resolve_step_cache,
    resolve_threads,
    resolve_tf32,
    schedule_compile,
    step_cache_unsupported,
)

#: Imported from here by the service, the CLI, the runtime and the tests.
__all__ = [
    "CONTROLS",
    "FALLBACK_STEPS",
    "InferenceRequest",
    "LoraPlanInput",
    "ModelFacts",
    "Plan",
    "plan_inference",
    "requested_by_control",
    "resolve_lora",
]

#: Steps assumed when neither the request nor a known checkpoint says.
FALLBACK_STEPS = 28


def plan_inference(
    registry: Registry,
    model: ModelFacts,
    hardware: HardwareProfile,
    request: InferenceRequest = InferenceRequest(),
    *,
    env: Mapping[str, str] | None = None,
    memory_thresholds: MemoryThresholds = MemoryThresholds(),
    cache_thresholds: StepCacheThresholds = StepCacheThresholds(),
    available: AvailableMemory | None = None,
) -> Plan:
    """Resolve every control; raise :class:`PreflightError` for a doomed request.

    :param available: the memory the job will have after eviction; its free
        figure replaces ``hardware``'s (default: ``hardware`` as it is).

    A load that goes to sd.cpp (the ``engine`` control) is sized from its files;
    where the torch path would not fit (fp32 on a CPU), the plan keeps sd.cpp
    and says there is no diffusers fallback (``Plan.diffusers_fits``).
    """
    env = os.environ if env is None else env
    available = available or available_memory(hardware)
    hardware = available.apply(hardware)
    _checked(resolve_speed_tier, request.speed, quantised=False)  # an unknown tier is refused first
    needs = (("LoRAs",) if request.loras.count else ()) + (("a ControlNet",) if model.controlnet_gb else ())
    engine = _checked(resolve_engine, request.engine, hardware, model.sdcpp, needs=needs)
    plan = functools.partial(_plan_torch, registry, model, request=request, env=env, engine=engine,
                             memory_thresholds=memory_thresholds, cache_thresholds=cache_thresholds)
    try:
        planned = plan(hardware, available)
    except PreflightError as exc:
        if engine.value != "sdcpp" or exc.code != "insufficient_memory":
            raise
        roomy = hardware.replace(free_memory_gb=None, total_memory_gb=10_000.0)
        reason = f"{engine.reason}; diffusers would not fit here ({exc.message}), so sd.cpp has no fallback"
        planned = plan(roomy, available_memory(roomy))
        return dataclasses.replace(planned.with_control("engine", dataclasses.replace(engine, reason=reason)),
                                   diffusers_fits=False, fallback=None)
    faster = torch_is_faster(str(planned.value("dtype")), hardware) if engine.source == "auto" else None
    if engine.value == "sdcpp" and faster:
        return dataclasses.replace(planned.with_control("engine", auto("diffusers", faster)), sdcpp=None)
    if engine.value == "sdcpp" and engine.source == "auto":
        reason = (f"{engine.reason}; torch would run {planned.value('dtype')} without native bf16 matmul here, "
                  "2.3x slower per step (bench/cpu_engines.py)")
        return planned.with_control("engine", dataclasses.replace(engine, reason=reason))
    return planned


def _plan_torch(
    registry: Registry, model: ModelFacts, hardware: HardwareProfile, available: AvailableMemory, *,
    request: InferenceRequest, env: Mapping[str, str], engine: Resolved[str],
    memory_thresholds: MemoryThresholds, cache_thresholds: StepCacheThresholds,
) -> Plan:
    """The torch (diffusers) controls of a plan, with the ``engine`` decided."""
    family = model.family
    family_denied = registry.quant_deny(family, "inference")
    quant_denied = lift_denials(family_denied, family, hardware)
    denied = registry.optimization_deny(family)
    encoder_quant = _checked(
        resolve_text_encoder_quant, family, hardware, request.text_encoder_quant,
        encoders_gb=model.sizes.text_encoders_gb, precast=model.precast_encoders,
    )
    shape = ImageShape(request.width or DEFAULT_SIDE_PX, request.height or DEFAULT_SIDE_PX, request.count)

    def thresholds(dtype: str) -> MemoryThresholds:
        """The memory knobs with the overhead guarded for ``shape`` in ``dtype``."""
        overhead, _ = guarded_overhead_gb(family, shape, 2 * DTYPE_FACTOR[dtype], memory_thresholds.overhead_gb)
        return dataclasses.replace(memory_thresholds, overhead_gb=overhead)

    def parts(dtype: str, scheme: str | None) -> Components:
        factor = DTYPE_FACTOR[dtype]
        sizes = model.sizes
        if scheme is not None:
            steady, transient = transformer_gb(
                sizes.transformer_gb, scheme, prequantised=scheme == model.prequantised_scheme,
                factor=family.quantisation.factor(scheme, inference=True),
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
            steady = transient = sizes.transformer_gb * factor
        lora_gb = request.loras.params * 2 * factor / 1e9  # adapters sit beside the denoiser
        steady, transient = steady + lora_gb, transient + lora_gb
        return Components(
            transformer_gb=steady,
            transformer_transient_gb=transient,
            text_encoders_gb=encoder_gb_as_planned(
                sizes.text_encoders_gb, str(encoder_quant.value), factor, model.precast_encoders
            ),
            vae_gb=sizes.vae_gb * factor,
            quantised=scheme is not None and scheme != "nf4",
            controlnet_gb=model.controlnet_gb * factor,
            denoiser_label=family.denoiser_label,
        )

    def memory(dtype: str, scheme: str | None, requested: str = request.memory) -> tuple[Resolved[str], MemoryEstimate] | None:
        try:
            return plan_memory(parts(dtype, scheme), hardware, requested, thresholds(dtype))
        except PreflightError:
            if requested != "auto":
                raise
            return None

    fp32_plan = memory("fp32", None, "auto")
    fp32_fits = fp32_plan is not None and fp32_plan[0].value in ("resident", "model_offload")
    dtype = resolve_dtype(family, hardware, request.dtype, fp32_fits=fp32_fits)
    quant = _checked(
        resolve_quant_request, request.quant, hardware, quant_denied, family_label=family.label,
        dtype=dtype.value, lifted=lifted_denials(family_denied, family, hardware),
    )
    base_quant = model.prequantised_scheme
    base_name = "GGUF" if model.gguf_transformer_gb is not None else "dense"
    base = memory(dtype.value, base_quant)
    choice = choose_transformer_scheme(
        quant, prequantised=model.prequantised_scheme, base=base, base_name=base_name,
        tier=request.speed, memory_for=lambda scheme: memory(dtype.value, scheme), label=family.denoiser_label,
    )
    chosen_quant, chosen, fallback_memory = choice.quant, choice.memory, choice.fallback_memory
    if chosen is None:
        try:  # the memory rule's own words (unified memory, RAM and swap, ...)
            plan_memory(parts(dtype.value, base_quant), hardware, "auto", thresholds(dtype.value))
            detail = ""
        except PreflightError as exc:
            detail = f": {exc.message}"
        raise PreflightError(
            f"{family.label} does not fit this machine ({hardware.device_name}, "
            f"{hardware.total_memory_gb:.1f} GB) in any plan{detail}",
            code="insufficient_memory",
        )

    def encoders_memory(
        scheme: str | None, mem: tuple[Resolved[str], MemoryEstimate]
    ) -> tuple[Resolved[str], tuple[Resolved[str], MemoryEstimate]]:
        if mem[0].source != "auto" and request.text_encoder_memory == "auto":
            return auto("resident", "the memory mode was set explicitly: the encoders follow it"), mem
        return _checked(
            resolve_text_encoder_memory, parts(dtype.value, scheme), mem, hardware,
            request.text_encoder_memory, thresholds(dtype.value),
        )

    encoder_memory, chosen = encoders_memory(chosen_quant.value, chosen)
    if fallback_memory is not None:
        fallback_encoder_memory, fallback_memory = encoders_memory(base_quant, fallback_memory)

    def assemble(
        scheme: Resolved[str | None], mem: tuple[Resolved[str], MemoryEstimate], fallback: Plan | None,
        encoder_memory: Resolved[str],
    ) -> Plan:
        estimate = mem[1]
        bytes_ = 2 * DTYPE_FACTOR[dtype.value]
        weights_at_decode = estimate.peak_gb - estimate.overhead_gb
        headroom = thresholds(dtype.value).resident_fraction * estimate.budget_gb - weights_at_decode - CONTEXT_GB
        if hardware.vendor == "cpu":
            headroom = estimate.budget_gb + (hardware.swap_free_gb or 0.0) - weights_at_decode
        vae_tiling = _checked(resolve_vae_tiling, family, headroom, bytes_, request.vae_tiling)
        quantised = scheme.value is not None or model.gguf_transformer_gb is not None
        tier = resolve_speed_tier(request.speed, quantised=quantised, label=family.denoiser_label)
        steps = request.steps or (model.checkpoint.default_steps if model.checkpoint else FALLBACK_STEPS)
        cache, threshold = _checked(
            resolve_step_cache, request.step_cache, steps,
            quantised=quantised, tier=tier.value, denied=denied, thresholds=cache_thresholds,
            unsupported=cache_unsupported,
        )
        cache_may_engage = cache.value == "fbcache" or (
            request.step_cache == "auto" and "step_cache" not in denied and tier.value != "off"
            and cache_unsupported is None
        )
        compiled, fullgraph = _checked(
            resolve_compile, request.compile, hardware, tier=tier.value,
            regions=registry.compile_regions(family), denied=denied,
            gguf=scheme.value is None and model.gguf_transformer_gb is not None,
            cache_may_engage=cache_may_engage,
            memory="resident" if hardware.vendor == "cpu" else mem[0].value,
            dtype=dtype.value, env=env,
        )
        compiled, from_image = schedule_compile(
            compiled, quantised=scheme.value is not None and scheme.value != "nf4"
        )
        attention, install = _checked(
            resolve_attention, request.attention, hardware, denied, env, dtype=dtype.value, tier=tier.value
        )
        controls: dict[str, Resolved] = {
            "engine": engine,
            "dtype": dtype,
            "transformer_quant": scheme,
            "text_encoder_dtype": Resolved(dtype.value, dtype.source, "the encoders run in the compute dtype"),
            "memory_mode": mem[0],
            "attention_backend": attention,
            "step_cache": cache,
            "compile": compiled,
            "speed_tier": tier,
            "fp16_accumulation": resolve_fp16_accumulation(
                hardware, dtype=dtype.value, tier=tier.value, denied=denied, env=env
            ),
            # sd.cpp computes on its CPU backend whatever the accelerator: its threads are the CPU's
            "threads": resolve_threads(hardware.replace(vendor="cpu") if engine.value == "sdcpp" else hardware,
                                       request.threads),
            "lora": resolve_lora(
                request.loras,
                quantised=scheme.value or ("GGUF" if model.gguf_transformer_gb is not None else None),
                compiled=compiled.value == "regional",
            ),
            "tf32": resolve_tf32(hardware, tier=tier.value),
            "text_encoder_quant": movable_encoder_quant(
                encoder_quant, "resident" if hardware.vendor == "cpu" else mem[0].value, str(encoder_memory.value),
                hardware,
            ),
            "text_encoder_memory": encoder_memory,
            "vae_tiling": vae_tiling,
            "vae_slicing": resolve_vae_slicing(family),
            "eager_fusions": resolve_eager_fusions(len(family.eager_fusions), tier=tier.value, env=env),
        }
        controls = with_requests(controls, requested_controls)
        sizes = {"table": model.table_sizes}
        if model.measured_sizes:
            sizes["measured"] = model.measured_sizes
        planned = Plan(
            family=family.name,
            checkpoint=model.checkpoint.name if model.checkpoint else None,
            device="cuda" if hardware.cuda else hardware.vendor,
            controls=MappingProxyType(controls),
            estimate=mem[1],
            step_cache_threshold=threshold,
            compile_fullgraph=fullgraph,
            attention_install=install,
            default_steps=steps,
            fallback=fallback,
            sizes=MappingProxyType(sizes),
            available=available,
            compile_from_image=from_image,
            gguf=scheme.value is None and model.gguf_transformer_gb is not None,
            step_cache_may_engage=cache_may_engage,
            denoiser_label=family.denoiser_label,
            sdcpp=model.sdcpp if engine.value == "sdcpp" else None,
        )
        refused = plan_refusals(planned)
        if refused:  # a resolver let through what the compatibility table refuses
            raise PreflightError(
                f"the plan combines options that do not work together: {'; '.join(refused)}",
                code="incompatible_plan",
            )
        return planned

    checkpoint = model.checkpoint
    cache_unsupported = step_cache_unsupported(
        family.cache_context_pipelines,
        (checkpoint.pipeline_class or family.pipeline_class) if checkpoint else None,
    )
    requested_controls = requested_by_control(request)
    fallback = None
    if fallback_memory is not None:
        fallback = assemble(
            explicit(None, f"fallback: the {base_name} transformer, if the {chosen_quant.value} build fails"),
            fallback_memory,
            None,
            fallback_encoder_memory,
        )
    return assemble(chosen_quant, chosen, fallback, encoder_memory)


def _checked(resolver, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Turn a resolver's ValueError (a bad request value) into a refusal."""
    try:
        return resolver(*args, **kwargs)
    except ValueError as exc:
        raise PreflightError(str(exc), code="invalid_request") from None
