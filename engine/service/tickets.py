"""What a check decided, handed to the job that acts on it: the load ticket.

``engine.images.check_load(...)`` resolves the model, reads the LoRA and
ControlNet files, and plans, loading nothing; it returns a :class:`LoadTicket`
with all of it. ``engine.images.load(ticket)`` then re-checks only what can
change between the two, cheaply, before anything is evicted:

- the files it read (their size and modification time: a LoRA rewritten
  between check and load is read again);
- the machine's capabilities, once torch has verified them (a stub torchao
  takes int8 away: the plan is re-made for what the machine can really do);
- the free memory, when it moved more than :data:`REPLAN_MARGIN_GB` (another
  process took the GPU meanwhile).

Anything else is the ticket's: the model is resolved once and planned once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.hardware.profile import HardwareProfile
    from engine.policy.plan import Plan
    from engine.preflight.lora import LoraFile
    from engine.preflight.source import ModelSource
    from engine.requests.inference import InferenceRequest

#: Free memory may move this much (GB) between check and load before the plan is re-made.
REPLAN_MARGIN_GB = 0.5

#: One file's (path, size, modification time in ns); (path, -1, -1) for one that is gone.
Stamp = tuple[str, int, int]


@dataclass(frozen=True)
class LoadTicket:
    """A load's checks, passed: everything :meth:`~engine.service.images.Images.load` needs.

    ``asked``: the arguments the check was given (model, base, family,
    switching), kept so a ticket whose files changed is checked again as asked."""

    asked: tuple[str, str | None, str | None, bool]
    source: ModelSource
    loras: tuple[LoraFile, ...]
    controlnet: str | None
    request: InferenceRequest
    plan: Plan
    #: Why diffusers could not take the model (sd.cpp's fallback reason), or None.
    refusal: EngineError | None
    #: The machine planned for, without its moment-to-moment figures.
    capabilities: HardwareProfile
    #: The free memory planned for (after evicting what the engine may evict), GB; None: unknown.
    available_gb: float | None
    #: Whether ``capabilities`` came from the torch-verified probe.
    verified: bool
    stamps: tuple[Stamp, ...]
    #: ``id`` of the :class:`~engine.service.images.Images` that issued it.
    owner: int

    @property
    def model(self) -> str:
        return self.asked[0]

    def files_changed(self) -> bool:
        """Whether a file the check read was rewritten, replaced or removed since."""
        return stamp_files(path for path, _, _ in self.stamps) != self.stamps

    def memory_moved(self, available_gb: float | None) -> bool:
        """Whether the free memory now differs from the planned figure by more than the margin."""
        if available_gb is None or self.available_gb is None:
            return available_gb != self.available_gb
        return abs(available_gb - self.available_gb) > REPLAN_MARGIN_GB


def ticket_files(source: ModelSource, loras: tuple[LoraFile, ...], controlnet: str | None) -> list[str]:
    """The local files and folders a load's check read: the model (and a folder's index),
    its base, the LoRAs and the ControlNet's config."""
    paths = [source.location, *([source.base] if source.base else [])]
    for folder in list(paths):
        for index in ("model_index.json", "config.json"):
            paths.append(os.path.join(folder, index))
    paths += [str(lora.path) for lora in loras]
    if controlnet is not None:
        paths += [controlnet, os.path.join(controlnet, "config.json")]
    return [p for p in paths if os.path.exists(p)]  # a hub id stamps nothing; a file gone later stamps -1


def stamp_files(paths: Iterable[str]) -> tuple[Stamp, ...]:
    stamps: list[Stamp] = []
    for path in paths:
        try:
            stat = Path(path).stat()
            stamps.append((str(path), stat.st_size, stat.st_mtime_ns))
        except OSError:
            stamps.append((str(path), -1, -1))
    return tuple(stamps)
