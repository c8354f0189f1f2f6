"""What the engine asks of a loaded model, whichever engine runs it: the :class:`Session` protocol.

Two runtimes load a model: diffusers (:class:`~engine.runtime.session.InferenceSession`)
and stable-diffusion.cpp (:class:`~engine.runtime.sdcpp.SdcppSession`). The facade holds
either, routes to it (:mod:`engine.runtime.engines`) and types against this protocol only,
so a third runtime (a video pipeline, another CPU engine) is one more class with these
members, and a member one runtime lacks is a type error rather than an ``AttributeError``
in a server at run time. ``tests/runtime/test_session_protocol.py`` checks both classes against it.

Torch-free: the request and image types are named for type checkers only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.errors import Cancelled

if TYPE_CHECKING:
    from PIL import Image

    from engine.contract.plugins import Registry
    from engine.policy.plan import Plan
    from engine.requests.inference import InferenceRequest
    from engine.preflight.lora import LoraFile
    from engine.preflight.source import ModelSource
    from engine.runtime.generation import GenerateRequest

#: ``progress(step, total)`` after each denoising step (raising stops the call there).
Progress = Callable[[int, int], None]


@runtime_checkable
class Session(Protocol):
    """One model loaded per a plan: the lifecycle every runtime gives the facade."""

    registry: Registry
    source: ModelSource
    #: The plan as the runtime recorded it (a fallback or a downgraded kernel included).
    plan: Plan
    request: InferenceRequest
    #: Why this session replaced another (``{"from", "to", "reason"}``), or None.
    fallback: dict[str, object] | None

    def load(self, progress: Progress | None = None) -> None:
        """Bring the model in (files read, weights placed per the plan)."""

    def generate(self, request: GenerateRequest, progress: Progress | None = None,
                 cancel: threading.Event | None = None) -> list[Image.Image]:
        """The request's images; ``cancel`` (set from any thread) stops the call as soon as
        the runtime can: before the next block for torch, at once for a worker process."""

    def set_loras(self, files: Sequence[LoraFile]) -> None:
        """Switch the LoRAs or their scales, or refuse what this runtime cannot apply."""

    def status(self) -> dict[str, object]:
        """What is loaded and how (the plan, the runtime's own facts), as JSON-able data."""

    def unload(self) -> None:
        """Release the model and everything the runtime holds for it."""


def cancellable(progress: Progress | None, cancel: threading.Event) -> Progress:
    """``progress`` that first raises :class:`~engine.errors.Cancelled` once ``cancel`` is set:
    every session calls it after each denoising step, so a torch pipeline stops there."""

    def step(done: int, total: int) -> None:
        if cancel.is_set():
            raise Cancelled(f"the generate was cancelled after step {done} of {total}")
        if progress is not None:
            progress(done, total)

    return step
