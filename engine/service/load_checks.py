"""The load's checks, cheapest first, and the re-check of a ticket before it is used.

:meth:`LoadChecks.check` resolves the model, asks diffusers' refusal, reads the LoRA and
ControlNet files and plans: everything :meth:`~engine.service.images.Images.check_load`
answers and :meth:`~engine.service.images.Images.load` re-checks only where something can
have changed (:meth:`LoadChecks.recheck`: see :mod:`engine.service.tickets`). Its own
module so the pipeline's state (:mod:`engine.service.images`) and its checks read apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.contract.plugins import Registry
from engine.errors import EngineError
from engine.policy.inference import Plan, plan_inference
from engine.preflight.borrowed import borrowed_access_error
from engine.preflight.hub import diffusers_refusal, weights_report
from engine.preflight.lora import plan_input as lora_plan_input
from engine.preflight.lora import read_loras, with_family
from engine.preflight.model import resolve_model
from engine.requests.inference import InferenceRequest
from engine.requests.loras import LoraLike, lora_choices
from engine.service.machine import Machine, capabilities
from engine.service.tickets import LoadTicket, stamp_files, ticket_files

if TYPE_CHECKING:
    from engine.preflight.source import ModelSource


class LoadChecks:
    """The checks of one :class:`~engine.service.loaded.LoadedModel` (``owner``: its id, stamped on its tickets)."""

    def __init__(self, registry: Registry, machine: Machine, allow_download: Callable[[], bool], owner: int) -> None:
        self._registry, self._machine = registry, machine
        self._allow_download, self._owner = allow_download, owner

    def allow_download(self) -> bool:
        """Whether a load may download now (the engine's consent, read at each check)."""
        return self._allow_download()

    def check(self, asked: tuple[str, str | None, str | None, bool], request: InferenceRequest,
               loras: Sequence[LoraLike], controlnet: str | None, *, verify: bool,
              shaped: Callable[[ModelSource], InferenceRequest] | None = None) -> LoadTicket:
        """The load's checks, cheapest first: nothing is imported that a refusal does not need.
        ``shaped(source)``: the request at the shape it runs at on that model (a generate's clip,
        decided once the model is known), before it is planned."""
        from engine.preflight.controlnet import check_controlnet

        model, base, family, switching = asked
        source = resolve_model(self._registry, model, family=family, base=base)
        refusal = diffusers_refusal(source, base_given=base is not None, allow_download=self._allow_download()) or (
            borrowed_access_error(source, allow_download=self._allow_download()))
        # LoRAs and a ControlNet run on diffusers only: with either, no sd.cpp path could take the model.
        diffusers_only = bool(loras) or controlnet is not None
        if refusal is not None and (diffusers_only or source.kind not in source.family.sdcpp.kinds):
            raise refusal  # refused first, whatever else the request carries
        lora_files = with_family(source.family, read_loras(lora_choices(loras)))  # a pair's halves on their experts
        if controlnet is not None:
            controlnet = check_controlnet(source.family, controlnet)
        if source.stored_layout is not None:  # converted on meta from the headers: never loaded wrong
            from engine.runtime.stored_layouts import check_stored_layout

            check_stored_layout(source)
        if lora_files:
            from engine.runtime.lora_check import check_loras

            lora_files = check_loras(self._registry, source, lora_files)  # counted: the plan says how many match
        if shaped is not None:
            request = shaped(source)
        request = dataclasses.replace(request, loras=lora_plan_input(lora_files, switching=switching,
                                                                     family=source.family))
        hardware = self._machine.hardware(verify=verify or None)
        available = self._machine.available_memory(verify=verify or None)
        plan = self.plan(source, controlnet, request, hardware, available)
        ticket = LoadTicket(
            asked=asked, source=source, loras=lora_files, controlnet=controlnet, request=request, plan=plan,
            refusal=refusal, capabilities=capabilities(hardware), available_gb=available.after_eviction_gb,
            verified=verify, stamps=stamp_files(ticket_files(source, lora_files, controlnet)), owner=self._owner,
            weights=weights_report(source, self._registry.component_sizes(source.family, source.checkpoint)),
        )
        return self.after_plan(ticket)

    def plan(self, source: ModelSource, controlnet: str | None, request: InferenceRequest,
              hardware: Any, available: Any) -> Plan:
        from engine.preflight.controlnet import with_controlnet

        return plan_inference(self._registry, with_controlnet(source.facts(self._registry), controlnet),
                              hardware, request, available=available)

    def after_plan(self, ticket: LoadTicket) -> LoadTicket:
        """The checks that read the plan: sd.cpp reads the files beside the model (no base,
        no hub), diffusers needs both; a verified load also checks the weightless components."""
        if ticket.plan.value("engine") != "sdcpp":
            if ticket.refusal is not None:
                raise ticket.refusal
            if ticket.verified:
                from engine.runtime.loading import check_weightless_components

                check_weightless_components(ticket.source)  # a processor missing a library fails here
        return ticket

    def recheck(self, ticket: LoadTicket) -> LoadTicket:
        """A ticket made usable for a load now: checked again only where something changed."""
        if ticket.owner != self._owner:
            raise EngineError("this load ticket was issued by another engine; check the load on this one",
                              code="invalid_request")
        if ticket.files_changed():  # a file was rewritten since: every check again, as asked
            loras = [{"path": str(lora.path), "scale": lora.scale, "partial": lora.partial} for lora in ticket.loras]
            return self.check(ticket.asked, _unplanned(ticket.request), loras, ticket.controlnet, verify=True)
        if ticket.verified:
            return ticket
        hardware = self._machine.hardware(verify=True)
        available = self._machine.available_memory(verify=True)
        if capabilities(hardware) != ticket.capabilities or ticket.memory_moved(available.after_eviction_gb):
            plan = self.plan(ticket.source, ticket.controlnet, ticket.request, hardware, available)
            ticket = dataclasses.replace(ticket, plan=plan, capabilities=capabilities(hardware),
                                         available_gb=available.after_eviction_gb)
        return self.after_plan(dataclasses.replace(ticket, verified=True))



def _unplanned(request: InferenceRequest) -> InferenceRequest:
    """A ticket's request without the LoRA plan input the check added (the check adds it again)."""
    return dataclasses.replace(request, loras=InferenceRequest().loras)
