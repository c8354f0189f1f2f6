"""Typed errors with stable codes.

Every refusal the engine makes is an :class:`EngineError` carrying a ``code``
that never changes between releases (UIs and HTTP clients switch on it) and a
message a user can act on: what is wrong, which file or name, what to do
instead. The CLI prints ``error[code]: message`` and exits 2; it never shows a
traceback for bad input.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from engine.error_catalogue import status_of


class EngineError(Exception):
    """Base of every refusal. ``code`` is stable; ``message`` is for people.

    Every code and its HTTP status are listed in :mod:`engine.error_catalogue`
    (``docs/errors.md``); :attr:`status` reads it. A plugin's own code, not
    listed there, gets its class's ``http_status`` (400 unless the class says).
    """

    code: str = "engine_error"
    #: The HTTP status of a code the catalogue does not list.
    http_status: int = 400
    #: The request's other refusals, found by the same check (:func:`together`).
    also: tuple[EngineError, ...] = ()

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def status(self) -> int:
        """The HTTP status the server answers this error with (the catalogue's, by code)."""
        return status_of(self.code, self.http_status)

    def to_dict(self) -> dict[str, object]:
        also = {"also": [error.to_dict() for error in self.also]} if self.also else {}
        return {"code": self.code, "message": self.message, **also}


def together(errors: Sequence[EngineError]) -> EngineError:
    """One refusal that reports every refusal of a request: the first's code and class, each
    message after it (``; also error[code]: ...``), the others in ``also``. A user fixes them
    in one go instead of meeting them one by one."""
    first, rest = errors[0], tuple(errors[1:])
    if not rest:
        return first
    joined = copy.copy(first)
    joined.message = first.message + "".join(f"; also error[{e.code}]: {e.message}" for e in rest)
    joined.args = (joined.message,)
    joined.also = rest
    return joined


class UnknownName(EngineError):
    """A name (family, preset, checkpoint...) that is not one of the valid ones."""

    code = "unknown_name"
    http_status = 404

    def __init__(self, kind: str, name: str, valid: Iterable[str], *, aliases: Iterable[str] = ()) -> None:
        import difflib

        self.kind = kind
        self.name = name
        self.valid = tuple(sorted(valid))
        #: The nearest valid name or alias (what a typo meant), or None.
        close = difflib.get_close_matches(name.lower(), [*self.valid, *aliases], n=1, cutoff=0.6)
        self.suggestion = close[0] if close else None
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        super().__init__(
            f"unknown {kind} {name!r}{hint}; valid {kind} names: {', '.join(self.valid) or '(none)'}",
            code=f"unknown_{kind.replace(' ', '_')}",
        )


class PluginError(EngineError):
    """A plugin broke the contract (strict mode) or two plugins collide."""

    code = "plugin_error"


class FamilyConflict(PluginError):
    """Two plugins claim the same family name or alias."""

    code = "family_conflict"


class HardwareProbeError(EngineError):
    code = "hardware_probe_failed"


class PreflightError(EngineError):
    """A request that cannot succeed, found before anything heavy happened.

    Returned (not raised) by the pure preflight functions, so a caller can
    collect or report them; raised by the service before it evicts anything.
    """

    code = "preflight_failed"


class Busy(EngineError):
    """Another job holds the engine; try again when it is done."""

    code = "busy"
    http_status = 409


class Cancelled(EngineError):
    """A generate was stopped at a step boundary because its caller asked (``cancel`` was set)."""

    code = "cancelled"


class UnsupportedWorkflow(EngineError):
    """The checkpoint has no pipeline for what the request asks (or a ControlNet it cannot take)."""

    code = "unsupported_workflow"
