"""What the registry reports about the plugins it loaded (re-exported by
:mod:`engine.contract.types`, where plugins and faces import them from)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin that could not be loaded, reported instead of raised."""

    plugin: str
    package: str
    error: str


@dataclass(frozen=True)
class PluginInfo:
    """What ``diffusion-engine families`` shows about one loaded plugin."""

    name: str
    package: str
    version: str
    hooks: tuple[str, ...]
    families: tuple[str, ...]
    builtin: bool = False
    #: The plugin API the plugin says it targets (``ENGINE_PLUGIN_API``); None: it does not say.
    api: int | None = None
    #: The earlier-API spellings it uses (each still read, with a ``DeprecationWarning``).
    deprecations: tuple[str, ...] = ()

