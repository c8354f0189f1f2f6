"""Typed errors with stable codes.

Every refusal the engine makes is an :class:`EngineError` carrying a ``code``
that never changes between releases (UIs and HTTP clients switch on it) and a
message a user can act on: what is wrong, which file or name, what to do
instead. The CLI prints ``error[code]: message`` and exits 2; it never shows a
traceback for bad input.
"""

from __future__ import annotations

from collections.abc import Iterable


class EngineError(Exception):
    """Base of every refusal. ``code`` is stable; ``message`` is for people."""

    code: str = "engine_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class UnknownName(EngineError):
    """A name (family, preset, checkpoint...) that is not one of the valid ones."""

    code = "unknown_name"

    def __init__(self, kind: str, name: str, valid: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = tuple(sorted(valid))
        super().__init__(
            f"unknown {kind} {name!r}; valid {kind} names: {', '.join(self.valid) or '(none)'}",
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


class Cancelled(EngineError):
    """A generate was stopped at a step boundary because its caller asked (``cancel`` was set)."""

    code = "cancelled"


class UnsupportedWorkflow(EngineError):
    """The checkpoint has no pipeline for what the request asks (or a ControlNet it cannot take)."""

    code = "unsupported_workflow"
