"""The machine the facade's decisions are made for, and the memory a new job would have.

Built from what the engine was given (a profile, a
:class:`~engine.requests.MachineRequest`, or nothing: a probe), resolved on
first use so building an engine probes nothing. The light answer
(``verify=None``) reads no torch; the verified one (``verify=True``) imports
torch and can only take capabilities away (a stub torchao, say), so a plan
made on the light one is re-made only when :func:`capabilities` differ.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.hardware.profile import HardwareProfile
from engine.policy.available import AvailableMemory, Releasable, available_memory
from engine.requests.machine import MachineRequest
from engine.service.residency import Residency
from engine.service.slot import PIPELINE, TRAINER


class Machine:
    """``hardware(verify)`` and ``available_memory(verify)`` for one engine."""

    def __init__(self, given: HardwareProfile | MachineRequest | None, residency: Residency,
                 held: Callable[[], Releasable | None]) -> None:
        """``held``: what the engine's loaded pipeline would release if evicted (None: none loaded)."""
        self._given = given
        self._residency = residency
        self._held = held
        self._resolved: dict[bool | None, HardwareProfile] = {}

    def hardware(self, *, verify: bool | None = None) -> HardwareProfile:
        """The machine decisions are made for: the one given, else a probe.

        A :class:`~engine.requests.MachineRequest` (a preset, or this machine with
        overrides) is resolved once per kind of probe for the engine's life."""
        if isinstance(self._given, MachineRequest):
            if verify not in self._resolved:
                self._resolved[verify] = self._given.profile(verify=verify)
            return self._resolved[verify]
        if self._given is not None:
            return self._given
        from engine.hardware.probe import probe

        return probe(verify=verify)

    def available_memory(self, *, verify: bool | None = None) -> AvailableMemory:
        """The memory a new job would have: free now plus what evicting the
        engine's pipeline and every registered resident would release.

        Measured before anything is evicted, so a doomed request is still
        refused with every resident in place."""
        releasable = [
            Releasable(r.name, r.size_gb, "declared by the host")
            for r in self._residency.residents() if r.name not in (PIPELINE, TRAINER)
        ]
        pipeline = self._held()
        if pipeline is not None:
            releasable.append(pipeline)
        return available_memory(self.hardware(verify=verify), releasable)


def capabilities(hardware: HardwareProfile) -> HardwareProfile:
    """A profile without its moment-to-moment figures (free memory, swap): what a plan's rules read."""
    return hardware.replace(free_memory_gb=None, swap_free_gb=None, source=None)
