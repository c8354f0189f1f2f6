"""The engine router: a plan's ``engine`` control picks the session that runs it.

``diffusers`` loads an :class:`~engine.runtime.session.InferenceSession`;
``sdcpp`` an :class:`~engine.runtime.sdcpp.SdcppSession`. When sd.cpp fails
(a file it refuses, a crash, out of memory), at load or at a generate, the
model is loaded on diffusers instead where it loads there (a single file
needs its base), and the session records why (``status()["fallback"]``), as
the earlier system's router did. Where diffusers cannot take it either, the
sd.cpp failure is raised, saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.policy.plan import Plan
from engine.requests.inference import InferenceRequest
from engine.policy.resolved import auto
from engine.preflight.lora import LoraFile
from engine.preflight.source import ModelSource
from engine.runtime.protocol import Session

if TYPE_CHECKING:
    from engine.runtime.sdcpp import SdcppSession


def start_session(
    registry: Registry, source: ModelSource, plan: Plan, request: InferenceRequest, *,
    loras: Sequence[LoraFile] = (), controlnet: str | None = None,
    diffusers_refusal: EngineError | None = None,
) -> Session:
    """A loaded session for ``plan``; ``diffusers_refusal``: why diffusers could not load
    this model (then an sd.cpp failure is not fallen back from)."""
    if plan.value("engine") == "sdcpp":
        from engine.runtime.sdcpp import SdcppFailed, SdcppSession

        session = SdcppSession(registry, source, plan, request)
        session.diffusers_refusal = diffusers_refusal
        try:
            session.load()
            return session
        except SdcppFailed as exc:
            return fall_back(registry, source, plan, request, exc, diffusers_refusal)
    from engine.runtime.attention import install_for_plan

    plan = install_for_plan(plan)  # before the session's import of diffusers: its kernels are read then
    from engine.runtime.session import InferenceSession

    session = InferenceSession(registry, source, plan, request, loras=loras, controlnet=controlnet)
    session.load()
    return session


def fall_back(
    registry: Registry, source: ModelSource, plan: Plan, request: InferenceRequest,
    failure: EngineError, diffusers_refusal: EngineError | None,
) -> Session:
    """The model loaded on diffusers after sd.cpp's ``failure``, with the reason recorded."""
    if diffusers_refusal is None and not plan.diffusers_fits:
        diffusers_refusal = EngineError(f"it would not fit this machine ({plan['engine'].reason})",
                                        code="insufficient_memory")
    if diffusers_refusal is not None:
        raise type(failure)(f"{failure.message}; diffusers cannot take this model over either: "
                            f"{diffusers_refusal.message}") from failure
    from engine.runtime.session import InferenceSession

    reason = f"fallback: stable-diffusion.cpp failed ({failure.message})"
    engine = dataclasses.replace(auto("diffusers", reason), requested=plan["engine"].asked)
    diffusers_plan = dataclasses.replace(plan.with_control("engine", engine), sdcpp=None)
    session = InferenceSession(registry, source, diffusers_plan, request)
    session.load()
    session.fallback = {"from": "sdcpp", "to": "diffusers", "reason": failure.message}
    return session


def fall_back_from(session: SdcppSession, failure: EngineError) -> Session:
    """A failed sd.cpp ``session``'s model, loaded on diffusers (a generate's fallback)."""
    session.unload()
    return fall_back(session.registry, session.source, session.plan, session.request, failure,
                     session.diffusers_refusal)
