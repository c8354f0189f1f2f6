"""The inference plan: every control resolved with its reason, before loading.

``plan_inference`` is pure and torch-free. It decides the compute dtype, the
transformer scheme, the memory mode and the speed controls for one model on
one machine, and returns a :class:`Plan`: a record of :class:`Resolved`
values keyed by the control names UIs and the HTTP API use.

The quantised plan carries a ``fallback``: the plan for the transformer as
given (dense, or the GGUF file). The runtime adopts the quantised plan only
when the quantised build succeeds, else it loads the fallback with the
fallback's own memory plan.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry
from engine.policy.dtype import DTYPE_FACTOR, resolve_dtype
from engine.policy.memory import (
    Components,
    MemoryEstimate,
    MemoryThresholds,
    mode_rank,
    plan_memory,
)
from engine.policy.quant import resolve_quant_request
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.schemes import transformer_gb
from engine.policy.speed import (
    StepCacheThresholds,
    resolve_attention,
    resolve_compile,
    resolve_fp16_accumulation,
    resolve_speed_tier,
    resolve_step_cache,
    resolve_threads,
)
from engine.types import Checkpoint, ComponentSizes, FamilySpec

#: The controls of a plan, in display order; these names are the JSON keys.
CONTROLS: tuple[str, ...] = (
    "dtype",
    "transformer_quant",
    "text_encoder_dtype",
    "memory_mode",
    "attention_backend",
    "step_cache",
    "compile",
    "speed_tier",
    "fp16_accumulation",
    "threads",
)

#: Steps assumed when neither the request nor a known checkpoint says.
FALLBACK_STEPS = 28


@dataclass(frozen=True)
class InferenceRequest:
    """What the user asked for; ``auto`` leaves a control to the engine."""

    dtype: str = "auto"
    quant: str = "auto"
    memory: str = "auto"
    attention: str = "auto"
    step_cache: str = "auto"
    compile: str = "auto"
    speed: str = "default"
    steps: int | None = None
    threads: int | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the planner knows about the model to load, without loading it."""

    family: FamilySpec
    checkpoint: Checkpoint | None
    table_sizes: ComponentSizes
    #: Sizes read from the checkpoint's own files, when it is local.
    measured_sizes: ComponentSizes | None = None
    #: The denoiser's steady GB per scheme, sized from its tensor shapes.
    measured_scheme_gb: Mapping[str, float] | None = None
    #: Size of a GGUF transformer file given instead of the dense one, GB.
    gguf_transformer_gb: float | None = None
    #: The transformer is stored pre-quantised in this scheme (``nf4``).
    prequantised_scheme: str | None = None

    @property
    def sizes(self) -> ComponentSizes:
        return self.measured_sizes or self.table_sizes


@dataclass(frozen=True)
class Plan:
    family: str
    checkpoint: str | None
    device: str
    controls: Mapping[str, Resolved]
    estimate: MemoryEstimate
    step_cache_threshold: float
    compile_fullgraph: bool
    #: A pip package to try installing for the attention backend, or None.
    attention_install: str | None
    default_steps: int
    fallback: Plan | None = None
    sizes: Mapping[str, ComponentSizes] = field(default_factory=dict)

    def __getitem__(self, control: str) -> Resolved:
        return self.controls[control]

    def value(self, control: str) -> object:
        return self.controls[control].value

    def with_control(self, control: str, resolved: Resolved) -> Plan:
        """A copy with one control re-decided (at load or generate time)."""
        controls = dict(self.controls)
        controls[control] = resolved
        return dataclasses.replace(self, controls=MappingProxyType(controls))

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "checkpoint": self.checkpoint,
            "device": self.device,
            "resolved": {name: self.controls[name].to_dict() for name in CONTROLS},
            "estimate": self.estimate.to_dict(),
            "step_cache_threshold": self.step_cache_threshold,
            "compile_fullgraph": self.compile_fullgraph,
            "attention_install": self.attention_install,
            "sizes": {k: dataclasses.asdict(v) for k, v in self.sizes.items()},
            "fallback": self.fallback.to_dict() if self.fallback else None,
        }


def plan_inference(
    registry: Registry,
    model: ModelFacts,
    hardware: HardwareProfile,
    request: InferenceRequest = InferenceRequest(),
    *,
    env: Mapping[str, str] | None = None,
    memory_thresholds: MemoryThresholds = MemoryThresholds(),
    cache_thresholds: StepCacheThresholds = StepCacheThresholds(),
) -> Plan:
    """Resolve every control; raise :class:`PreflightError` for a doomed request."""
    env = os.environ if env is None else env
    family = model.family
    tier = _checked(resolve_speed_tier, request.speed)
    quant_denied = registry.quant_deny(family, "inference")
    denied = registry.optimization_deny(family)

    def parts(dtype: str, scheme: str | None) -> Components:
        factor = DTYPE_FACTOR[dtype]
        sizes = model.sizes
        if scheme is not None:
            steady, transient = transformer_gb(
                sizes.transformer_gb, scheme, prequantised=scheme == model.prequantised_scheme,
                factor=family.quant_factors.get(scheme),
            )
            if model.measured_scheme_gb and scheme in model.measured_scheme_gb:
                steady = model.measured_scheme_gb[scheme]
        elif model.gguf_transformer_gb is not None:
            steady = transient = model.gguf_transformer_gb
        else:
            steady = transient = sizes.transformer_gb * factor
        return Components(
            transformer_gb=steady,
            transformer_transient_gb=transient,
            text_encoders_gb=sizes.text_encoders_gb * factor,
            vae_gb=sizes.vae_gb * factor,
            quantised=scheme is not None and scheme != "nf4",
        )

    def memory(dtype: str, scheme: str | None, requested: str = request.memory) -> tuple[Resolved[str], MemoryEstimate] | None:
        try:
            return plan_memory(parts(dtype, scheme), hardware, requested, memory_thresholds)
        except PreflightError:
            if requested != "auto":
                raise
            return None

    fp32_plan = memory("fp32", None, "auto")
    fp32_fits = fp32_plan is not None and fp32_plan[0].value in ("resident", "model_offload")
    dtype = resolve_dtype(family, hardware, request.dtype, fp32_fits=fp32_fits)
    quant = _checked(
        resolve_quant_request, request.quant, hardware, quant_denied, family_label=family.label
    )
    base_quant = model.prequantised_scheme
    base_name = "GGUF" if model.gguf_transformer_gb is not None else "dense"
    base = memory(dtype.value, base_quant)
    chosen_quant: Resolved[str | None]
    fallback_memory = None
    if model.prequantised_scheme:
        chosen_quant = auto(model.prequantised_scheme, "the checkpoint is stored pre-quantised")
        chosen = base
    elif quant.source == "explicit":
        chosen_quant, chosen = quant, (memory(dtype.value, quant.value) if quant.value else base)
        if quant.value:
            fallback_memory = base
    elif quant.value is None:
        chosen_quant, chosen = quant, base
    else:
        candidate = memory(dtype.value, quant.value)
        better = candidate is not None and (
            base is None or mode_rank(candidate[0].value) < mode_rank(base[0].value)
        )
        if better:
            mode = candidate[0].value  # type: ignore[index]
            was = base[0].value if base else "not fitting at all"
            chosen_quant = auto(quant.value, f"the {base_name} transformer plans {was}; {quant.value} plans {mode}. {quant.reason}")
            chosen, fallback_memory = candidate, base
        elif base is not None and tier.value == "max" and quant.value in ("fp8", "mxfp8", "int8"):
            chosen_quant = auto(quant.value, f"max tier: {quant.value} GEMMs for speed. {quant.reason}")
            chosen, fallback_memory = candidate or base, base
        else:
            where = base[0].value if base else "nowhere"
            chosen_quant = auto(None, f"the {base_name} transformer plans {where}; quantising would not improve the plan (candidate: {quant.value})")
            chosen = base
    if chosen is None:
        raise PreflightError(
            f"{family.label} does not fit this machine ({hardware.device_name}, "
            f"{hardware.total_memory_gb:.1f} GB) in any plan",
            code="insufficient_memory",
        )

    def assemble(scheme: Resolved[str | None], mem: tuple[Resolved[str], MemoryEstimate], fallback: Plan | None) -> Plan:
        quantised = scheme.value is not None or model.gguf_transformer_gb is not None
        steps = request.steps or (model.checkpoint.default_steps if model.checkpoint else FALLBACK_STEPS)
        cache, threshold = _checked(
            resolve_step_cache, request.step_cache, steps,
            quantised=quantised, tier=tier.value, denied=denied,
        )
        cache_may_engage = (
            request.step_cache == "auto" and "step_cache" not in denied and tier.value != "off"
        )
        compiled, fullgraph = _checked(
            resolve_compile, request.compile, hardware, tier=tier.value,
            regions=registry.compile_regions(family), denied=denied,
            gguf=scheme.value is None and model.gguf_transformer_gb is not None,
            cache_may_engage=cache_may_engage,
        )
        attention, install = _checked(resolve_attention, request.attention, hardware, denied, env)
        controls: dict[str, Resolved] = {
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
            "threads": resolve_threads(hardware, request.threads),
        }
        sizes = {"table": model.table_sizes}
        if model.measured_sizes:
            sizes["measured"] = model.measured_sizes
        return Plan(
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
        )

    fallback = None
    if fallback_memory is not None:
        fallback = assemble(
            explicit(None, f"fallback: the {base_name} transformer, if the {chosen_quant.value} build fails"),
            fallback_memory,
            None,
        )
    return assemble(chosen_quant, chosen, fallback)


def _checked(resolver, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Turn a resolver's ValueError (a bad request value) into a refusal."""
    try:
        return resolver(*args, **kwargs)
    except ValueError as exc:
        raise PreflightError(str(exc), code="invalid_request") from None
