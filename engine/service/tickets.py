"""What a check decided, handed to the job that acts on it: the load and generate tickets.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.hardware.profile import HardwareProfile
    from engine.policy.plan import Plan
    from engine.preflight.lora import LoraFile
    from engine.contract.types import Checkpoint, FamilySpec
    from engine.policy.video import VideoShape
    from engine.preflight.source import ModelSource
    from engine.requests.bodies import GenerateBody
    from engine.requests.inference import InferenceRequest

#: Free memory may move this much (GB) between check and load before the plan is re-made.
REPLAN_MARGIN_GB = 0.5

#: One file's (path, size, modification time in ns); (path, -1, -1) for one that is gone.
Stamp = tuple[str, int, int]


@dataclass(frozen=True)
class LoadTicket:
    """A load's checks, passed: everything :meth:`engine.images.load` needs.

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
    #: ``id`` of the :class:`~engine.service.loaded.LoadedModel` that issued it.
    owner: int
    #: Whether the weights are here, and if not the download a load needs (``weights_report``).
    weights: Mapping[str, object] = field(default_factory=dict)

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


@dataclass(frozen=True)
class Target:
    """A model a job runs on, and the ticket that loads it."""

    ticket: LoadTicket

    @property
    def key(self) -> str:
        """Which model: its location (the same folder loaded twice is one model)."""
        return self.ticket.source.location

    @property
    def name(self) -> str:
        """What a job or a listing calls it: the folder's or file's name, else the checkpoint's."""
        return model_name(self.ticket.source)

    @property
    def family(self) -> FamilySpec:
        return self.ticket.source.family

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.ticket.source.checkpoint


@dataclass(frozen=True)
class GenerateTicket:
    """A generate's checks, passed: what :meth:`engine.images.generate` (or ``engine.videos``)
    runs, each decision made once. ``engine.images.check_generate(body)`` makes it, loading
    nothing; the generate re-checks only what can change (the files it read, and, when its
    model must load, the load ticket's files and free memory).

    ``asked``: the check's own arguments, kept so a ticket whose files changed is checked
    again as asked."""

    asked: tuple[Any, ...]
    #: The request as it runs (its ``model`` judged and dropped; a clip's frames, size and fps decided).
    body: GenerateBody
    #: ``images`` or ``frames``: the door it was checked through.
    output: str
    #: The model it runs on, resolved and planned at the request's shape (the loaded one: its load's ticket).
    target: Target
    #: A clip's shape (video models), else None.
    shape: VideoShape | None
    #: The input images as the call takes them (paths, uploaded bytes or pictures), by request field.
    inputs: tuple[tuple[str, Any], ...]
    #: Their (width, height), read from their headers once, by the name a refusal gives each.
    sizes: tuple[tuple[str, tuple[int, int]], ...]
    #: The LoRAs the call switches to, read once; None keeps the loaded ones.
    loras: tuple[LoraFile, ...] | None
    #: Seconds asked of a clip, snapped onto frames ("" when none was).
    note: str
    stamps: tuple[Stamp, ...]
    owner: int

    @property
    def model(self) -> str:
        """The model's location."""
        return self.target.key

    @property
    def plan(self) -> Plan:
        """The plan the model loads with (the loaded one's: its load's)."""
        return self.target.ticket.plan

    @property
    def count(self) -> int:
        """Outputs it makes: one clip, or the request's images."""
        return 1 if self.shape is not None else len(self.body.images())

    def files_changed(self) -> bool:
        """Whether an input image or LoRA file it read was rewritten, replaced or removed since."""
        return stamp_files(path for path, _, _ in self.stamps) != self.stamps


def model_name(source: ModelSource) -> str:
    """A model's short name: its folder or file name, or (a hub id) the id itself."""
    location = source.location.rstrip(os.sep)
    return os.path.basename(location) if os.path.exists(location) else location


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
