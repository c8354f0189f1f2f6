"""Loading family plugins into an immutable :class:`Registry`.

``load_registry()`` is a factory: nothing happens at import time and there is
no module-level registry. It loads each entry point of the
``diffusion_engine.families`` group on its own, so one plugin that fails to
import is reported (and listed by ``diffusion-engine families``) instead of
taking the host down; ``DIFFUSION_ENGINE_STRICT_PLUGINS=1`` makes such a
failure fatal. ``DIFFUSION_ENGINE_BLOCK_PLUGINS=a,b`` skips entry points by
name or by distribution. Two plugins claiming one family name (or alias) is
an error naming both packages.

Core code never calls ``pm.hook.*`` itself: the :class:`Registry` exposes one
typed method per hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import pluggy

from engine.contract import hookspecs
from engine.contract.registry import Registry as Registry
from engine.errors import FamilyConflict, PluginError
from engine.contract.plugin_api import PluginDeprecationWarning, declared_api, shape_refusal, version_refusal
from engine.deprecation import deprecate
from engine.deprecation import register as register_row
from engine.contract.types import (
    FamilySpec,
    PluginInfo,
    PluginLoadError,
)

STRICT_ENV = "DIFFUSION_ENGINE_STRICT_PLUGINS"
#: Set to 1 to log, on stderr, which plugin answered each hook call.
TRACE_ENV = "DIFFUSION_ENGINE_TRACE_PLUGINS"
BLOCK_ENV = "DIFFUSION_ENGINE_BLOCK_PLUGINS"
TABLE_PLUGIN_NAME = "engine.table_plugin"


@dataclass
class _Loading:
    """Mutable state while one registry is being built; discarded after."""

    pm: pluggy.PluginManager
    strict: bool
    errors: list[PluginLoadError]
    packages: dict[str, tuple[str, str]]  # plugin name -> (package, version)
    #: plugin name -> the earlier-API spellings it used (messages of the shims' warnings).
    deprecations: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: plugin name -> the plugin API it declares.
    apis: dict[str, int | None] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def noting_deprecations(self, plugin: str) -> Iterator[None]:
        """Note the plugin-API shims' warnings ``plugin`` triggers, and let every warning through."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for warning in caught:
            if issubclass(warning.category, PluginDeprecationWarning):
                self.deprecations.setdefault(plugin, []).append(str(warning.message))
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)

    def fail(self, plugin: str, package: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.strict:
            raise PluginError(
                f"plugin {plugin!r} from {package}: {message} "
                f"(unset {STRICT_ENV} to report it and go on)",
                code="plugin_load_failed",
            )
        self.errors.append(PluginLoadError(plugin=plugin, package=package, error=message))


def _identity(dist: importlib.metadata.Distribution | None, known: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """``dist``'s name and version, read from its metadata once (each read parses the file
    anew, and one package carries many families: the engine's own sixteen)."""
    if dist is None:
        return "?", "?"
    if id(dist) not in known:
        metadata = dist.metadata
        known[id(dist)] = (metadata["Name"] or "?", metadata["Version"] or "?")
    return known[id(dist)]


def load_registry(
    *,
    plugins: Iterable[tuple[str, object]] = (),
    entry_points: bool = True,
    env: Mapping[str, str] | None = None,
) -> Registry:
    """Load every family plugin and freeze the result.

    :param plugins: extra ``(name, plugin)`` pairs registered directly (apps
        and tests that do not ship an entry point).
    :param entry_points: load the ``diffusion_engine.families`` entry points.
    :param env: environment to read the strict and block switches from.
    """
    env = os.environ if env is None else env
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    from engine import table_plugin

    pm.register(table_plugin, name=TABLE_PLUGIN_NAME)
    loading = _Loading(
        pm=pm,
        strict=env.get(STRICT_ENV, "") not in ("", "0", "false"),
        errors=[],
        packages={TABLE_PLUGIN_NAME: (BUILT_IN_PACKAGE, _version(BUILT_IN_PACKAGE))},
    )
    blocked = {b.strip() for b in env.get(BLOCK_ENV, "").split(",") if b.strip()}
    if entry_points:
        identities: dict[int, tuple[str, str]] = {}  # a package's name and version, its metadata parsed once
        for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            package, version = _identity(ep.dist, identities)
            if ep.name in blocked or package in blocked:
                continue
            try:
                with loading.noting_deprecations(ep.name):
                    plugin = ep.load()
            except TypeError as exc:  # a plugin object of a shape no shim reads
                loading.fail(ep.name, package, shape_refusal(None, exc))
                continue
            except Exception as exc:  # a broken plugin must not take the host down
                loading.fail(ep.name, package, exc)
                continue
            _register(loading, ep.name, plugin, package, version)
    for name, plugin in plugins:
        module = str(getattr(plugin, "__module__", None) or getattr(plugin, "__name__", name))
        _register(loading, name, plugin, module.split(".")[0], "")
    _check_pending(loading)
    families, owners = _collect_families(loading)
    aliases = {
        alias.lower().replace("-", "_"): spec.name
        for spec in families.values()
        for alias in spec.aliases
    }
    if env.get(TRACE_ENV, "") not in ("", "0", "false"):
        _trace_answers(loading)
    return Registry(
        families=MappingProxyType(dict(sorted(families.items()))),
        plugins=_plugin_infos(loading, owners),
        errors=tuple(loading.errors),
        _pm=pm,
        _aliases=MappingProxyType(aliases),
    )


def _register(loading: _Loading, name: str, plugin: object, package: str, version: str) -> None:
    declared = declared_api(plugin)
    refusal = version_refusal(declared)
    if refusal is not None:
        loading.fail(name, package, refusal)
        return
    loading.apis[name] = declared
    if loading.pm.has_plugin(name):
        other = loading.packages.get(name, ("?", ""))[0]
        loading.fail(name, package, f"plugin name {name!r} is already registered by {other}")
        return
    try:
        loading.pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        loading.fail(name, package, exc)
        return
    loading.packages[name] = (package, version)


def _check_pending(loading: _Loading) -> None:
    """Hook implementations with no spec are typos: drop the plugin, report it."""
    while True:
        try:
            loading.pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = loading.pm.get_name(exc.plugin) or "?"
            loading.pm.unregister(exc.plugin)
            package = loading.packages.pop(name, ("?", ""))[0]
            loading.fail(name, package, exc)


#: What a plugin may still declare that the engine now derives: rows of the register (a plugin told so).
DERIVED = {"side_multiple": register_row(
    "Rendering(side_multiple=N) equal to its geometry's token side", "no side_multiple (the engine derives it from "
    "rendering.geometry: VAE stride x patch)", kind="plugin")}


class FamilyShadowed(UserWarning):
    """An installed plugin serves a family the engine also builds in: the plugin's is used."""


#: The distribution whose entry points are the engine's own families.
BUILT_IN_PACKAGE = "diffusion-engine"


def _shadowing(loading: _Loading, families: dict[str, FamilySpec], owners: dict[str, str],
               claimed: dict[str, str], key: str, spec: FamilySpec, owner: str) -> bool:
    """Two plugins claim ``key``. An installed plugin's family wins over the engine's built-in family
    of the same name (it was installed to serve it, and written before the engine had one: it
    keeps working across the release that adds the built-in), with a :class:`FamilyShadowed`
    warning naming both; True where ``spec`` goes on registering, False where it is the built-in
    left out. Two installed plugins (or two built-ins) claiming one name, and a family claiming
    another's name as its alias, stay a :class:`FamilyConflict`."""
    holder = claimed[key]
    packages = {name: loading.packages.get(name, ("?", ""))[0] for name in (holder, owner)}
    ours = {name: packages[name] == BUILT_IN_PACKAGE for name in (holder, owner)}
    held = next(name for name, by in owners.items() if by == holder and key in _keys(families[name]))
    if ours[holder] == ours[owner] or _keys(families[held])[0] != _keys(spec)[0]:  # an alias squatted: no
        raise FamilyConflict(
            f"family {key!r} is claimed by two plugins: {packages[holder]} (plugin {holder!r}) and "
            f"{packages[owner]} (plugin {owner!r}); uninstall one or block it with {BLOCK_ENV}"
        )
    plugin, builtin = (owner, holder) if ours[holder] else (holder, owner)
    warnings.warn(FamilyShadowed(
        f"family {key!r}: the installed plugin {plugin!r} ({packages[plugin]}) is used in place of the engine's "
        f"built-in {builtin!r}; to use the built-in, block the plugin with {BLOCK_ENV}={plugin}"), stacklevel=2)
    if not ours[holder]:
        return False
    for name in [name for name, by in owners.items() if by == holder and key in _keys(families[name])]:
        for gone in _keys(families.pop(name)):
            claimed.pop(gone, None)
        owners.pop(name)
    return True


def _keys(spec: FamilySpec) -> list[str]:
    return [key.lower().replace("-", "_") for key in (spec.name, *spec.aliases)]


def _collect_families(loading: _Loading) -> tuple[dict[str, FamilySpec], dict[str, str]]:
    families: dict[str, FamilySpec] = {}
    owners: dict[str, str] = {}  # family name -> plugin name
    claimed: dict[str, str] = {}  # family name or alias -> plugin name
    caller = loading.pm.hook.engine_register_families
    for impl in reversed(caller.get_hookimpls()):  # registration order
        plugin_name = impl.plugin_name
        package = loading.packages.get(plugin_name, ("?", ""))[0]

        def register(spec: FamilySpec, _owner: str = plugin_name, _pkg: str = package) -> None:
            if not isinstance(spec, FamilySpec):
                raise PluginError(f"{_pkg} registered {spec!r}, which is not a FamilySpec")
            for key in (spec.name, *spec.aliases):
                key = key.lower().replace("-", "_")
                if key in claimed and not _shadowing(loading, families, owners, claimed, key, spec, _owner):
                    return  # a built-in family an installed plugin already serves
            _check_runtime_module(spec, _pkg)
            for field in spec.rendering.derived_declarations():
                deprecate(DERIVED[field], stacklevel=3)  # told once per process, as every row's warning is
            for key in (spec.name, *spec.aliases):
                claimed[key.lower().replace("-", "_")] = _owner
            owners[spec.name] = _owner
            families[spec.name] = spec

        try:
            with loading.noting_deprecations(plugin_name):
                impl.function(register=register)
        except FamilyConflict:
            raise
        except TypeError as exc:  # a FamilySpec (or part) of a shape no shim reads
            loading.fail(plugin_name, package, shape_refusal(loading.apis.get(plugin_name), exc))
        except Exception as exc:  # a plugin's own bug is its error, not the host's
            loading.fail(plugin_name, package, exc)
    return families, owners


def _check_runtime_module(spec: FamilySpec, package: str) -> None:
    """A named runtime module must exist (found, not imported: it holds the family's torch code)."""
    import importlib.util

    if not spec.runtime_module:
        return
    try:
        found = importlib.util.find_spec(spec.runtime_module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise PluginError(f"{package} registered {spec.name!r} with runtime_module {spec.runtime_module!r}, "
                          "which is not an importable module (engine.contract.family_runtime)")


def _trace_answers(loading: _Loading, write: Callable[[str], object] | None = None) -> None:
    """Log every hook call's answer: which plugin (and package) returned it.

    A ``firstresult`` hook is answered by the first implementation that
    returns something (pluggy calls them newest-first, ``trylast`` ones
    last), so a third-party plugin that overrides a table answer shows up
    here by name; a collected hook lists every plugin that added to it.
    """
    out = write or (lambda line: print(line, file=sys.stderr))
    for plugin in loading.pm.get_plugins():
        for caller in loading.pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin or getattr(impl.function, "__traced__", False):
                    continue
                package, version = loading.packages.get(impl.plugin_name, ("?", ""))
                impl.function = _traced(  # type: ignore[misc]  # pluggy's Final: the trace wraps it in place
                    impl.function, caller.name, f"{impl.plugin_name} ({package} {version})".strip(), out)


def _traced(function: Callable[..., object], hook: str, who: str,
            write: Callable[[str], object]) -> Callable[..., object]:
    def traced(*args: object, **kwargs: object) -> object:
        result = function(*args, **kwargs)
        if result is not None:
            shown = repr(result)
            write(f"trace[plugins]: {hook} answered by {who}: {shown[:120]}{'...' if len(shown) > 120 else ''}")
        return result

    traced.__traced__ = True  # type: ignore[attr-defined]
    return traced


def _plugin_infos(loading: _Loading, owners: Mapping[str, str]) -> tuple[PluginInfo, ...]:
    infos = []
    for name, plugin in loading.pm.list_name_plugin():
        package, version = loading.packages.get(name, ("?", ""))
        callers = loading.pm.get_hookcallers(plugin) or []
        infos.append(
            PluginInfo(
                name=name,
                package=package,
                version=version,
                hooks=tuple(sorted(c.name for c in callers)),
                families=tuple(sorted(f for f, owner in owners.items() if owner == name)),
                builtin=name == TABLE_PLUGIN_NAME,
                api=loading.apis.get(name),
                deprecations=tuple(dict.fromkeys(loading.deprecations.get(name, ()))),
            )
        )
    return tuple(sorted(infos, key=lambda i: (i.builtin, i.name)))


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""

