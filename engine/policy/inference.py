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
the LoRA mode in :mod:`engine.policy.lora`, ...). This module decides the
``engine`` control and retries sd.cpp's sizing on a roomy machine; the
:class:`~engine.policy.torch_plan.TorchPlanner` sizes the components and
assembles the resolved controls into a plan and its fallback.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from engine.contract.plugins import Registry
from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.available import AvailableMemory, available_memory
from engine.policy.lora import resolve_lora
from engine.policy.memory import MemoryThresholds
from engine.policy.parallel import split_plan
from engine.policy.plan import CONTROLS, ModelFacts, Plan, requested_by_control
from engine.policy.resolved import auto
from engine.policy.runtime_engine import resolve_engine, torch_is_faster, torch_is_slower
from engine.policy.speed import StepCacheThresholds, resolve_speed_tier
from engine.policy.torch_plan import FALLBACK_STEPS, TorchPlanner, checked
from engine.requests.inference import InferenceRequest, LoraPlanInput

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
    and says there is no diffusers fallback (``Plan.diffusers_fits``). A request for
    several ranks (``gpus``) is split last (:func:`~engine.policy.parallel.split_plan`).
    """
    env = os.environ if env is None else env
    available = available or available_memory(hardware)
    hardware = available.apply(hardware)
    planned = _one_process(registry, model, hardware, request, env=env, memory_thresholds=memory_thresholds,
                           cache_thresholds=cache_thresholds, available=available)
    return split_plan(planned, model, hardware, request)


def _one_process(registry: Registry, model: ModelFacts, hardware: HardwareProfile, request: InferenceRequest, *,
                 env: Mapping[str, str], memory_thresholds: MemoryThresholds,
                 cache_thresholds: StepCacheThresholds, available: AvailableMemory) -> Plan:
    """The plan of one process: every control but the split."""
    checked(resolve_speed_tier, request.speed, quantised=False)  # an unknown tier is refused first
    needs = (("LoRAs",) if request.loras.count else ()) + (("a ControlNet",) if model.controlnet_gb else ())
    engine = checked(resolve_engine, request.engine, hardware, model.sdcpp, needs=needs)
    def plan(hardware: HardwareProfile, available: AvailableMemory) -> Plan:
        return TorchPlanner(
            registry, model, hardware, available, request=request, env=env, engine=engine,
            memory_thresholds=memory_thresholds, cache_thresholds=cache_thresholds,
        ).plan()

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
    dtype, kernel = str(planned.value("dtype")), planned.value("cpu_kernel")
    kernel = str(kernel) if kernel else None
    faster = torch_is_faster(dtype, hardware, kernel) if engine.source == "auto" else None
    if engine.value == "sdcpp" and faster:
        return dataclasses.replace(planned.with_control("engine", auto("diffusers", faster)), sdcpp=None)
    if engine.value == "sdcpp" and engine.source == "auto":
        reason = f"{engine.reason}; {torch_is_slower(dtype, hardware, kernel)}"
        return planned.with_control("engine", dataclasses.replace(engine, reason=reason))
    return planned


