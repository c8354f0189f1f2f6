"""A decision with its provenance: what was asked, what was chosen, by whom, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")
Source = Literal["auto", "explicit"]
Status = Literal["engaged", "fell back", "refused", "not applicable"]
STATUSES: tuple[str, ...] = ("engaged", "fell back", "refused", "not applicable")

#: Values that mean "nothing of this control is in effect".
_INACTIVE: tuple[object, ...] = (None, False, "off", "none")
#: Request spellings that name the same thing as a resolved value.
_SAME_AS: Mapping[object, object] = {"none": None, "on": "regional"}


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """``value`` chosen by the engine (``auto``) or the user (``explicit``).

    ``reason`` names the rule that fired, so a UI can show "Auto: int8" with
    the reason as its tooltip, and a log says why without a debugger.
    ``requested`` is what the user asked for (``"auto"`` when they left it to
    the engine; None when not recorded, then read from ``source``), so
    "fp8 on an A100" says it was asked for and not given; ``status`` says
    how the request ended (see :func:`derive_status`), derived when None.
    """

    value: T
    source: Source
    reason: str
    requested: object = None
    status: str | None = None

    @property
    def asked(self) -> object:
        """What was asked for: ``requested``, else ``auto`` / the value by source."""
        if self.requested is not None:
            return self.requested
        return "auto" if self.source == "auto" else self.value

    @property
    def outcome(self) -> str:
        return self.status or derive_status(self.asked, self.value)

    @property
    def overridden(self) -> bool:
        """An explicit request the engine did not honour: it fell back to
        something else or was refused (requested vs decided differ)."""
        asked_for = self.source == "explicit" or self.asked not in ("auto", "default")
        return asked_for and self.outcome in ("fell back", "refused")

    def with_request(self, requested: object) -> Resolved[T]:
        """A copy that records ``requested`` (what the user asked for)."""
        return dataclasses.replace(self, requested=requested)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: a value that is a record of its own (an expert choice) is its dict."""
        return {
            "value": _plain(self.value),
            "source": self.source,
            "reason": self.reason,
            "requested": _plain(self.asked),
            "status": self.outcome,
            "overridden": self.overridden,
        }


def _plain(value: object) -> object:
    """A value as JSON holds it: a record of its own (``to_dict``) as its dict."""
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


def derive_status(requested: object, value: object) -> str:
    """How a request ended.

    - ``engaged``: what was asked is in effect (``auto`` chose something active,
      or an explicit value is honoured, ``off`` included);
    - ``not applicable``: ``auto``, and the control is off here (no cache at 4
      steps, no quantisation on a card that fits the dense model);
    - ``fell back``: an explicit request replaced by something else active
      (sage asked, native SDPA used);
    - ``refused``: an explicit request that left the control off (fp8 asked
      on an A100: no scheme).
    """
    if requested == "auto":
        return "not applicable" if value in _INACTIVE else "engaged"
    if _SAME_AS.get(requested, requested) == value or requested == value:
        return "engaged"
    return "refused" if value in _INACTIVE else "fell back"


def auto(value: T, reason: str) -> Resolved[T]:
    return Resolved(value, "auto", reason)


def explicit(value: T, reason: str = "requested", *, requested: object = None) -> Resolved[T]:
    """An explicit request's outcome; pass ``requested`` when ``value`` differs from it."""
    return Resolved(value, "explicit", reason, requested)


def with_requests(
    controls: Mapping[str, Resolved[Any]], requested: Mapping[str, object]
) -> dict[str, Resolved[Any]]:
    """``controls`` with each one's ``requested`` filled from ``requested``
    (``auto`` for a control the user cannot set), where its resolver left it open."""
    return {
        name: resolved if resolved.requested is not None else resolved.with_request(requested.get(name, "auto"))
        for name, resolved in controls.items()
    }
