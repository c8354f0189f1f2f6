"""Old spellings that still work for a release, each with the release that removes it.

As diffusers' ``deprecate`` does: a deprecated name warns with what to write
instead, and once the package's own version reaches the release named for its
removal, the shim raises :class:`ShimExpired` instead of warning, so a test
(and the release that forgot it) fails until the old spelling is deleted.
Every shim is registered in :data:`SHIMS`, the list the migration notes and
``tests/test_deprecation.py`` read.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.version import __version__

#: The release the spellings deprecated now are removed in.
NEXT_REMOVAL = "0.3.0"


class EngineDeprecationWarning(FutureWarning):
    """A spelling of the engine's public API that a later release removes.

    A FutureWarning, as diffusers warns: shown to the app's users by default,
    not only under a test runner."""


class ShimExpired(RuntimeError):
    """A deprecated spelling outlived the release that was to remove it: delete it."""


@dataclass(frozen=True)
class Shim:
    """One deprecated spelling: ``old`` still works until ``removed_in``; write ``new``."""

    old: str
    new: str
    removed_in: str = NEXT_REMOVAL


#: Every deprecated spelling, by its old name (the migration notes list them).
SHIMS: dict[str, Shim] = {}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.2.0"`` -> ``(0, 2, 0)``; a suffix (``0.3.0.dev1``, ``1.0rc1``) is cut at its first non-digit."""
    parts = []
    for piece in version.split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def register(old: str, new: str, removed_in: str = NEXT_REMOVAL) -> Shim:
    """Record a deprecated spelling (once per name; a second registration must agree)."""
    shim = Shim(old, new, removed_in)
    known = SHIMS.setdefault(old, shim)
    if known != shim:
        raise ValueError(f"{old} is deprecated twice, differently: {known} and {shim}")
    return shim


def deprecate(shim: Shim, *, stacklevel: int = 3, version: str = __version__) -> None:
    """Warn that ``shim.old`` was used; raise :class:`ShimExpired` at or past its removal release."""
    if version_tuple(version) >= version_tuple(shim.removed_in):
        raise ShimExpired(f"{shim.old} was to be removed in {shim.removed_in} and this is {version}: "
                          f"delete the shim (callers write {shim.new})")
    warnings.warn(f"{shim.old} is deprecated and will be removed in {shim.removed_in}; use {shim.new}",
                  EngineDeprecationWarning, stacklevel=stacklevel)


class moved:  # noqa: N801 - used as a decorator-like field, as ``property`` is
    """A method whose spelling moved: ``Engine.load`` -> ``Engine.images.load``.

    ``path``: where it lives now, dotted from the instance (``images.load``). It still
    works until its shim's release, warning once per call with the new spelling;
    ``adapt`` turns the new method's answer into the old one's shape. ``old`` defaults
    to ``Owner.attr()`` (the class it is set on)."""

    def __init__(self, old: str | None, new: str, path: str, adapt: Callable[[Any], Any] | None = None) -> None:
        self.old, self.new, self.path, self.adapt = old, new, path, adapt
        self.shim: Shim | None = None

    def __set_name__(self, owner: type, attr: str) -> None:
        self.shim = register(self.old or f"{owner.__name__}.{attr}()", self.new)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        target = instance
        for name in self.path.split("."):
            target = getattr(target, name)
        shim, adapt = self.shim, self.adapt
        assert shim is not None

        @functools.wraps(target)
        def call(*args: Any, **kwargs: Any) -> Any:
            deprecate(shim)
            answer = target(*args, **kwargs)
            return adapt(answer) if adapt is not None else answer

        return call
