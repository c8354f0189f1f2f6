"""The register of old spellings: every one still read, its new spelling, the release that removes it.

One row (:class:`Shim`) per old spelling, of every kind the engine has had:

- ``engine``: a facade method that moved into a part (``Engine.load`` ->
  ``Engine.images.load``), a door's method that moved to the loaded model;
- ``plugin``: a plugin API 0 field or argument (``FamilySpec(lora_targets=...)``);
- ``module``: a module's earlier name (``engine.types`` -> ``engine.contract.types``);
- ``flag``: a CLI flag (``--model-family`` -> ``--family``);
- ``setting``: a server setting (``ServerSettings.keep_url_images_s``).

A row is made where its old spelling lives (:func:`register`, or :class:`moved` for a
method), and :func:`deprecate` is the one way any of them warns, as diffusers'
``deprecate`` does: with what to write instead and when the old spelling goes
(:class:`EngineDeprecationWarning`, a FutureWarning shown to users by default;
:class:`PluginDeprecationWarning` for a plugin's). Once the package's own version reaches a
row's release, :func:`deprecate` raises :class:`ShimExpired` instead, so the release that
forgot to delete it fails. ``python -m engine.deprecation`` renders the register into
docs/migration.md; ``tests/house/test_deprecation.py`` checks that no warning of an old
spelling is given outside it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.version import __version__

#: The release the engine's own spellings deprecated now are removed in.
NEXT_REMOVAL = "0.3.0"
#: The release plugin API 0's spellings are removed in: plugins written against API 0 and 1
#: load unchanged under API 2, so their spellings outlive one more release.
PLUGIN_REMOVAL = "0.4.0"
#: Where a plugin author reads what moved.
PLUGIN_DOCS = "docs/plugins.md#migration"

Kind = Literal["engine", "plugin", "module", "flag", "setting"]
KINDS: tuple[Kind, ...] = ("engine", "plugin", "module", "flag", "setting")


class EngineDeprecationWarning(FutureWarning):
    """A spelling of the engine's public API that a later release removes.

    A FutureWarning, as diffusers warns: shown to the app's users by default,
    not only under a test runner."""


class PluginDeprecationWarning(EngineDeprecationWarning):
    """A plugin used a spelling of an earlier plugin API (still read, removed in the row's release)."""


class ShimExpired(RuntimeError):
    """A deprecated spelling outlived the release that was to remove it: delete it."""


@dataclass(frozen=True)
class Shim:
    """One deprecated spelling: ``old`` still works until ``removed_in``; write ``new``."""

    old: str
    new: str
    removed_in: str = NEXT_REMOVAL
    kind: Kind = "engine"

    @property
    def category(self) -> type[EngineDeprecationWarning]:
        return PluginDeprecationWarning if self.kind in ("plugin", "module") else EngineDeprecationWarning

    def message(self) -> str:
        """What the warning says: the old spelling, the new one, when the old goes (and for a
        plugin's, where its migration is told)."""
        if self.kind in ("plugin", "module"):
            return (f"{self.old} is a spelling of an earlier plugin API, deprecated: use {self.new} "
                    f"(see {PLUGIN_DOCS}); it will be removed in {self.removed_in}")
        return f"{self.old} is deprecated and will be removed in {self.removed_in}; use {self.new}"


#: The register: every deprecated spelling, by its old name.
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


def register(old: str, new: str, removed_in: str | None = None, *, kind: Kind = "engine") -> Shim:
    """Record a deprecated spelling (once per name; a second registration must agree).
    ``removed_in`` defaults by kind: :data:`PLUGIN_REMOVAL` for a plugin's, else :data:`NEXT_REMOVAL`."""
    if removed_in is None:
        removed_in = PLUGIN_REMOVAL if kind in ("plugin", "module") else NEXT_REMOVAL
    shim = Shim(old, new, removed_in, kind)
    known = SHIMS.setdefault(old, shim)
    if known != shim:
        raise ValueError(f"{old} is deprecated twice, differently: {known} and {shim}")
    return shim


def deprecate(shim: Shim | str, *, stacklevel: int = 3, version: str = __version__) -> None:
    """Warn that ``shim.old`` was used (a row, or its old name); raise :class:`ShimExpired` at or
    past its removal release. A name the register does not hold is a bug: KeyError."""
    row = SHIMS[shim] if isinstance(shim, str) else shim
    if version_tuple(version) >= version_tuple(row.removed_in):
        raise ShimExpired(f"{row.old} was to be removed in {row.removed_in} and this is {version}: "
                          f"delete the shim (callers write {row.new})")
    warnings.warn(row.message(), row.category, stacklevel=stacklevel)


def told(shim: Shim) -> list[str]:
    """``shim``'s warning as text lines (for a face that prints its own: the CLI's
    ``warning[deprecated]: ...``), raising as :func:`deprecate` does once it expired."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EngineDeprecationWarning)
        deprecate(shim)
    return [str(warning.message) for warning in caught]


def render() -> str:
    """The register as a Markdown table, by kind then old spelling (docs/migration.md's)."""
    lines = ["| Old | New | Kind | Removed in |", "|---|---|---|---|"]
    for shim in sorted(SHIMS.values(), key=lambda s: (KINDS.index(s.kind), s.old)):
        lines.append(f"| `{shim.old.removesuffix('()')}` | `{shim.new}` | {shim.kind} | {shim.removed_in} |")
    return "\n".join(lines) + "\n"


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


def load_register() -> dict[str, Shim]:
    """Every row, its registering modules imported (the engine modules that import this one;
    found by their text, so nothing here names them)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        if path.name == "deprecation.py" or "engine.deprecation import" not in path.read_text(encoding="utf-8"):
            continue
        name = ".".join(("engine", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EngineDeprecationWarning)  # an alias module warns as it loads
            importlib.import_module(name)
    return SHIMS


#: The markers around the register's table in docs/migration.md.
BEGIN, END = "<!-- register: rendered by python -m engine.deprecation -->", "<!-- /register -->"


def page_with_register(page: str) -> str:
    """``page`` (docs/migration.md) with the block between the markers replaced by :func:`render`."""
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{render()}{END}{tail}"


if __name__ == "__main__":  # the module's own objects, not this script's copies of them
    from pathlib import Path

    from engine import deprecation

    deprecation.load_register()
    notes = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
    notes.write_text(deprecation.page_with_register(notes.read_text(encoding="utf-8")), encoding="utf-8")
