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
from engine.policy.available import AvailableMemory, available_memory
from engine.policy.compatibility import pair_refusal, plan_refusals
from engine.policy.activations import (
    CONTEXT_GB,
    DEFAULT_SIDE_PX,
    ImageShape,
    guarded_overhead_gb,
    resolve_vae_slicing,
    resolve_vae_tiling,
)
from engine.policy.dtype import DTYPE_FACTOR, resolve_dtype
from engine.policy.encoders import encoder_gb, resolve_text_encoder_memory, resolve_text_encoder_quant
from engine.policy.memory import (
    Components,
    MemoryEstimate,
    MemoryThresholds,
    mode_rank,
    plan_memory,
)
from engine.policy.quant import lift_denials, resolve_quant_request
from engine.policy.resolved import Resolved, auto, explicit, with_requests
from engine.policy.schemes import HOST_QUANTISED, transformer_gb
from engine.policy.speed import (
    StepCacheThresholds,
    resolve_attention,
    resolve_compile,
    resolve_fp16_accumulation,
    resolve_speed_tier,
    resolve_step_cache,
    resolve_threads,
    resolve_tf32,
    schedule_compile,
    step_cache_unsupported,
)
from engine.types import Checkpoint, ComponentSizes, FamilySpec

#: The controls of a plan, in display order; these names are the JSON keys.
CONTROLS: tuple[str, ...] = (
    "dtype",
    "transformer_quant",
    "text_encoder_dtype",
    "text_encoder_quant",
    "text_encoder_memory",
    "memory_mode",
    "attention_backend",
    "step_cache",
    "compile",
    "speed_tier",
    "fp16_accumulation",
    "threads",
    "lora",
    "tf32",
    "vae_tiling",
    "vae_slicing",
)

#: Steps assumed when neither the request nor a known checkpoint says.
FALLBACK_STEPS = 28


@dataclass(frozen=True)
class LoraPlanInput:
    """The LoRAs a load applies, as the planner sees them (read from headers)."""

    count: int = 0
    #: The largest rank among them (the hot-swap slot size under compile).
    max_rank: int = 0
    #: Parameters in their LoRA matrices, all together.
    params: int = 0
    #: The caller will change LoRAs or scales on the loaded pipeline.
    switching: bool = False


def resolve_lora(loras: LoraPlanInput, *, quantised: str | None, compiled: bool) -> Resolved[str]:
    """How LoRAs are applied: ``fused`` into the weights (one LoRA on a dense
    base, no switch expected: no per-step cost), ``unfused`` (peft layers beside
    the base: a quantised or GGUF base, several LoRAs, or switching), or
    ``hotswap`` (unfused, in slots of the largest rank, so a compiled
    denoiser swaps adapters without recompiling)."""
    if loras.count == 0:
        return auto("none", "no LoRA requested")
    why = []
    base = {"GGUF": "gguf"}.get(quantised or "none", quantised or "none")
    unfusable = pair_refusal("lora", "fused", "quant", base)
    if quantised and unfusable:
        why.append(f"the base is {quantised} ({unfusable})")
    if loras.count > 1:
        why.append(f"{loras.count} LoRAs keep separate scales")
    if loras.switching:
        why.append("LoRAs will be switched on the loaded pipeline")
    if compiled and pair_refusal("lora", "unfused", "compile", "regional"):
        because = "; ".join(why) or "compile is on"
        return auto("hotswap", f"{because}: adapters are hot-swapped in rank-{loras.max_rank} slots so a switch does not recompile")
    if why:
        return auto("unfused", "; ".join(why) + ": adapters stay beside the base weights")
    return auto("fused", "one LoRA on a dense base: fused into the weights, no per-step cost")


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
    loras: LoraPlanInput = LoraPlanInput()
    text_encoder_quant: str = "auto"
    text_encoder_memory: str = "auto"
    vae_tiling: str = "auto"
    #: The image size and batch the activation guard sizes for (None: 1024 px).
    width: int | None = None
    height: int | None = None
    count: int = 1


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
    #: The memory the plan was made for (free after eviction, with sources).
    available: AvailableMemory | None = None
    #: The image (1-based) of a session before which regional compile runs
    #: (1: at load; a dense auto compile waits, so a one-off image is not slowed).
    compile_from_image: int = 1
    #: The transformer is a GGUF file (``transformer_quant`` None: not re-quantised).
    gguf: bool = False
    #: An auto step cache may engage at some generate of the session.
    step_cache_may_engage: bool = False

    def __getitem__(self, control: str) -> Resolved:
        return self.controls[control]

    def value(self, control: str) -> object:
        return self.controls[control].value

    def with_control(self, control: str, resolved: Resolved) -> Plan:
        """A copy with one control re-decided (at load or generate time); it
        keeps what was requested unless ``resolved`` says."""
        controls = dict(self.controls)
        if resolved.requested is None and control in controls:
            resolved = resolved.with_request(controls[control].asked)
        controls[control] = resolved
        return dataclasses.replace(self, controls=MappingProxyType(controls))

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "checkpoint": self.checkpoint,
            "device": self.device,
            "resolved": {name: self.controls[name].to_dict() for name in CONTROLS if name in self.controls},
            "estimate": self.estimate.to_dict(),
            "step_cache_threshold": self.step_cache_threshold,
            "compile_fullgraph": self.compile_fullgraph,
            "compile_from_image": self.compile_from_image,
            "attention_install": self.attention_install,
            "sizes": {k: dataclasses.asdict(v) for k, v in self.sizes.items()},
            "fallback": self.fallback.to_dict() if self.fallback else None,
            "available_memory": self.available.to_dict() if self.available else None,
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
    available: AvailableMemory | None = None,
) -> Plan:
    """Resolve every control; raise :class:`PreflightError` for a doomed request.

    :param available: the memory the job will have after eviction; its free
        figure replaces ``hardware``'s (default: ``hardware`` as it is).
    """
    env = os.environ if env is None else env
    available = available or available_memory(hardware)
    hardware = available.apply(hardware)
    family = model.family
    tier = _checked(resolve_speed_tier, request.speed)
    quant_denied = lift_denials(registry.quant_deny(family, "inference"), family, hardware)
    denied = registry.optimization_deny(family)
    encoder_quant = _checked(
        resolve_text_encoder_quant, family, hardware, request.text_encoder_quant,
        encoders_gb=model.sizes.text_encoders_gb,
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
                factor=family.inference_quant_factors.get(scheme, family.quant_factors.get(scheme)),
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
            text_encoders_gb=encoder_gb(sizes.text_encoders_gb, str(encoder_quant.value), factor),
            vae_gb=sizes.vae_gb * factor,
            quantised=scheme is not None and scheme != "nf4",
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
        dtype=dtype.value,
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
            clash = chosen and pair_refusal("quant", quant.value, "memory", chosen[0].value)
            if clash:
                raise PreflightError(
                    f"quant={quant.value} with memory={chosen[0].value}: {clash}. "  # type: ignore[index]
                    "Use memory=auto (or another memory mode) or another quant.",
                    code="incompatible_options",
                )
    elif quant.value is None:
        chosen_quant, chosen = quant, base
    else:
        candidate = memory(dtype.value, quant.value)
        if candidate is not None and pair_refusal("quant", quant.value, "memory", candidate[0].value):
            candidate = None  # the asked memory mode cannot carry this scheme: stay as given
        better = candidate is not None and (
            base is None or mode_rank(candidate[0].value) < mode_rank(base[0].value)
        )
        if better:
            mode = candidate[0].value  # type: ignore[index]
            was = base[0].value if base else "not fitting at all"
            chosen_quant = auto(quant.value, f"the {base_name} transformer plans {was}; {quant.value} plans {mode}. {quant.reason}")
            chosen, fallback_memory = candidate, base
        elif candidate is not None and base is not None and tier.value == "max" and quant.value in ("fp8", "mxfp8", "int8"):
            chosen_quant = auto(quant.value, f"max tier: {quant.value} GEMMs for speed. {quant.reason}")
            chosen, fallback_memory = candidate, base
        else:
            where = base[0].value if base else "nowhere"
            chosen_quant = auto(None, f"the {base_name} transformer plans {where}; quantising would not improve the plan (candidate: {quant.value})")
            chosen = base
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
        steps = request.steps or (model.checkpoint.default_steps if model.checkpoint else FALLBACK_STEPS)
        cache, threshold = _checked(
            resolve_step_cache, request.step_cache, steps,
            quantised=quantised, tier=tier.value, denied=denied, unsupported=cache_unsupported,
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
            resolve_attention, request.attention, hardware, denied, env, dtype=dtype.value
        )
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
            "lora": resolve_lora(
                request.loras,
                quantised=scheme.value or ("GGUF" if model.gguf_transformer_gb is not None else None),
                compiled=compiled.value == "regional",
            ),
            "tf32": resolve_tf32(hardware, tier=tier.value),
            "text_encoder_quant": encoder_quant,
            "text_encoder_memory": encoder_memory,
            "vae_tiling": vae_tiling,
            "vae_slicing": resolve_vae_slicing(family),
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


def requested_by_control(request: InferenceRequest) -> dict[str, object]:
    """What the user asked of each control (``auto`` where they left it)."""
    return {
        "dtype": request.dtype,
        "transformer_quant": request.quant,
        "text_encoder_dtype": request.dtype,
        "memory_mode": request.memory,
        "attention_backend": request.attention,
        "step_cache": request.step_cache,
        "compile": request.compile,
        "speed_tier": "auto" if request.speed == "default" else request.speed,
        "threads": "auto" if request.threads is None else request.threads,
        "text_encoder_quant": request.text_encoder_quant,
        "text_encoder_memory": request.text_encoder_memory,
        "vae_tiling": request.vae_tiling,
    }


def _checked(resolver, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Turn a resolver's ValueError (a bad request value) into a refusal."""
    try:
        return resolver(*args, **kwargs)
    except ValueError as exc:
        raise PreflightError(str(exc), code="invalid_request") from None
