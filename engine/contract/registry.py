"""The :class:`Registry`: the loaded families and plugins, frozen, with one
typed method per hook (core code never calls ``pm.hook.*`` itself).

:func:`engine.contract.plugins.load_registry` builds it; this module only
reads what was loaded. The runtime hooks pass torch objects through without
the registry importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pluggy

from engine.contract.training_types import TrainingObjective
from engine.contract.types import (
    CallShape,
    PURPOSES,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    PluginInfo,
    PluginLoadError,
    Purpose,
)
from engine.errors import PluginError, UnknownName

if TYPE_CHECKING:
    from engine.hardware.profile import HardwareProfile


#: The hooks whose default answer is the runtime's (torch objects pass through them).
RUNTIME_HOOKS = ("engine_lora_add", "engine_lora_state_dict", "engine_lora_load", "engine_pipeline_output",
                 "engine_pipeline_sound")


@dataclass(frozen=True)
class Registry:
    """The loaded families and plugins, frozen. Pass it around; do not rebuild it per call."""

    families: Mapping[str, FamilySpec]
    plugins: tuple[PluginInfo, ...]
    errors: tuple[PluginLoadError, ...]
    _pm: pluggy.PluginManager
    _aliases: Mapping[str, str]

    # -- lookup -------------------------------------------------------------

    def family(self, name: str) -> FamilySpec:
        """The family called ``name`` (or an alias); :class:`UnknownName` otherwise."""
        for key in dict.fromkeys((name.lower(), name.lower().replace("-", "_"))):  # a plugin's own hyphens first
            canonical = self._aliases.get(key, key)
            if canonical in self.families:
                return self.families[canonical]
        raise UnknownName("family", name, self.families, aliases=self._aliases)

    def hook_implementations(self, hook: str) -> list[dict[str, object]]:
        """The plugins implementing ``hook``, in the order pluggy calls them (the first
        that answers a ``firstresult`` hook wins); :class:`UnknownName` for no such hook."""
        caller = getattr(self._pm.hook, hook, None)
        if caller is None or not hook.startswith("engine_"):
            names = [n for n in dir(self._pm.hook) if n.startswith("engine_")]
            raise UnknownName("hook", hook, names)
        packages = {p.name: (p.package, p.version) for p in self.plugins}
        return [
            {"plugin": impl.plugin_name, "package": packages.get(impl.plugin_name, ("?", ""))[0],
             "version": packages.get(impl.plugin_name, ("?", ""))[1],
             "order": "tryfirst" if impl.tryfirst else "trylast" if impl.trylast else "normal",
             "firstresult": bool(caller.spec and caller.spec.opts.get("firstresult"))}
            for impl in reversed(caller.get_hookimpls())
        ]

    def family_for_pipeline_class(self, class_name: str) -> FamilySpec | None:
        """The family whose pipelines have ``model_index.json`` ``_class_name``."""
        return next(
            (f for f in self.families.values() if class_name in f.pipeline_class_names), None
        )

    def family_for_model_id(self, model_id: str) -> FamilySpec | None:
        """The family whose checkpoint patterns match a repo id or folder name; the most specific
        pattern wins across families as within one (``Model-2.1`` is not the family of ``Model``,
        whose ``*model*`` matches it too); on a tie, the first registered."""
        scores = [(max(c.match_score(model_id) for c in f.checkpoints), f) for f in self.families.values()]
        best = max((score for score, _ in scores), default=0)
        return next((f for score, f in scores if best and score == best), None)

    # -- one typed method per hook -----------------------------------------

    def component_sizes(
        self, family: FamilySpec, checkpoint: Checkpoint | None = None
    ) -> ComponentSizes:
        sizes = self._pm.hook.engine_component_sizes(family=family, checkpoint=checkpoint)
        return sizes if sizes is not None else family.sizes

    def quant_deny(self, family: FamilySpec, purpose: Purpose) -> Mapping[str, str]:
        """Scheme -> reason for every scheme any plugin denies; reasons joined."""
        return MappingProxyType({s: "; ".join(r) for s, r in self.quant_deny_reasons(family, purpose).items()})

    def quant_deny_reasons(self, family: FamilySpec, purpose: Purpose) -> Mapping[str, tuple[str, ...]]:
        """Scheme -> each plugin's reason apart (a rule that lifts one deny keeps the others)."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}, not {purpose!r}")
        return _reasons(
            (d.scheme, d.reason)
            for answer in self._pm.hook.engine_quant_deny(family=family, purpose=purpose)
            for d in answer or ()
        )

    def optimization_deny(self, family: FamilySpec) -> Mapping[str, str]:
        """Optimisation -> reason for everything any plugin denies ``family``."""
        return _union(
            (d.optimization, d.reason)
            for answer in self._pm.hook.engine_optimization_deny(family=family)
            for d in answer or ()
        )

    def dense_base(self, family: FamilySpec, repo: str) -> str | None:
        dense: str | None = self._pm.hook.engine_dense_base(family=family, repo=repo)
        return dense

    def training_precision_modes(
        self, family: FamilySpec, hardware: HardwareProfile
    ) -> tuple[str, ...]:
        modes = self._pm.hook.engine_training_precision_modes(family=family, hardware=hardware)
        return tuple(modes or ())

    def compile_regions(self, family: FamilySpec) -> tuple[str, ...]:
        return tuple(self._pm.hook.engine_compile_regions(family=family) or ())

    def training_objective(self, family: FamilySpec) -> TrainingObjective | None:
        objective: TrainingObjective | None = self._pm.hook.engine_training_objective(family=family)
        return objective

    # -- runtime hooks (torch objects pass through; the registry imports none) --

    def answer(self, hook: str, **arguments: object) -> Any:
        """The first plugin's answer to the runtime hook ``hook`` (``engine_lora_add``,
        ``engine_lora_state_dict``, ``engine_lora_load``, ``engine_pipeline_output``); None where
        no family plugin answers. The engine's own default answers live with the runtime
        (:mod:`engine.runtime.family_hooks`), which asks here first: the contract imports no runtime."""
        if hook not in RUNTIME_HOOKS:
            raise ValueError(f"{hook} is not one of the runtime hooks {', '.join(RUNTIME_HOOKS)}")
        return getattr(self._pm.hook, hook)(**arguments)

    def generate_kwargs(self, family: FamilySpec, pipeline: object, kwargs: dict[str, Any],
                        shape: CallShape | None = None) -> dict[str, Any]:
        """The arguments to call ``pipeline`` with for one generate (``shape``: the request's, as decided)."""
        shape = shape or CallShape(width=kwargs.get("width"), height=kwargs.get("height"))
        answer = self._pm.hook.engine_generate_kwargs(family=family, pipeline=pipeline, kwargs=dict(kwargs),
                                                      shape=shape)
        return dict(kwargs if answer is None else answer)

    def build_tiny_pipeline(self, family: FamilySpec, path: Path, checkpoint: Checkpoint | None = None) -> Path:
        """A tiny pipeline of ``family`` written to ``path``: of ``checkpoint``'s own
        pipeline class where one is given (a checkpoint loading as another class)."""
        built = self._pm.hook.engine_build_tiny_pipeline(family=family, path=Path(path), checkpoint=checkpoint)
        if built is None:
            which = f" {checkpoint.name}" if checkpoint is not None else ""
            raise PluginError(
                f"no plugin can build a tiny {family.name}{which} pipeline",
                code="no_tiny_pipeline",
            )
        return Path(built)


def _reasons(pairs: Iterable[tuple[str, str]]) -> Mapping[str, tuple[str, ...]]:
    """Name -> each distinct reason, over every plugin's deny answers."""
    denied: dict[str, list[str]] = {}
    for name, reason in pairs:
        reasons = denied.setdefault(name, [])
        if reason not in reasons:
            reasons.append(reason)
    return MappingProxyType({name: tuple(r) for name, r in denied.items()})


def _union(pairs: Iterable[tuple[str, str]]) -> Mapping[str, str]:
    """Name -> reasons joined, over every plugin's deny answers."""
    return MappingProxyType({name: "; ".join(r) for name, r in _reasons(pairs).items()})
