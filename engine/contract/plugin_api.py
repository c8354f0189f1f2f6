"""The plugin API's version, and the spellings of earlier versions it still reads.

The engine publishes :data:`PLUGIN_API_VERSION`. A plugin module may declare
the version it was written for (``ENGINE_PLUGIN_API = 1``); one that targets a
newer API than this engine provides is refused at load, saying which it needs
and which it got. A plugin written against an older API keeps working for one
major version: each spelling that moved is a row of the engine's one register of
old spellings (:mod:`engine.deprecation`), read through a shim that warns with
:class:`~engine.deprecation.PluginDeprecationWarning` naming the new spelling, the docs
section (``docs/plugins.md#migration``) and the release that removes it, and
``diffusion-engine families`` lists them per plugin. A shape no shim covers
fails to load with the API-version message instead of a bare ``TypeError``.

Plugin API 1 (this release) grouped :class:`~engine.contract.types.FamilySpec`'s flat
fields into sections; :data:`RENAMED` is the table of every move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from engine.deprecation import PluginDeprecationWarning, deprecate, register

__all__ = [  # PluginDeprecationWarning and deprecate are the register's, re-exported: plugin API 1 code reads them here
    "DECLARATION", "MIGRATION_DOCS", "OLDEST_SUPPORTED", "PLUGIN_API_VERSION", "RENAMED", "SPLIT", "Move",
    "PluginDeprecationWarning", "declared_api", "deprecate", "legacy_read", "sections_from_legacy", "shape_refusal",
    "version_refusal",
]

#: The plugin API this engine provides.
PLUGIN_API_VERSION = 2
#: The oldest API whose spellings are still read (through the shims below).
OLDEST_SUPPORTED = 0
#: Where a plugin declares the API it targets (a module- or object-level constant).
DECLARATION = "ENGINE_PLUGIN_API"
MIGRATION_DOCS = "docs/plugins.md#migration"




@dataclasses.dataclass(frozen=True)
class Move:
    """One flat ``FamilySpec`` field of plugin API 0 and where it lives now."""

    section: str
    field: str
    #: Old value -> new value (where the shape changed, not only the place).
    convert: Callable[[Any], Any] | None = None
    #: New value -> old value, for a plugin that still reads the old name.
    back: Callable[[Any], Any] | None = None


def _deny_of(purpose: str) -> Callable[[Any], Any]:
    return lambda mapping: tuple(dict(mapping).get(purpose, ()))


#: Every flat field that moved into a section: plugin API 0's into API 1's, API 1's loose ones into API 2's.
RENAMED: Mapping[str, Move] = {
    "training_dense_gb": Move("training", "dense_gb"),
    "base_precision_applies": Move("training", "base_precision_applies"),
    "training_requires_bf16": Move("training", "requires_bf16"),
    "training_objective": Move("training", "objective"),
    "training_memory": Move("training", "memory"),
    "training_defaults": Move("training", "defaults"),
    "lora_targets": Move("lora", "targets"),
    "lora_key_markers": Move("lora", "key_markers"),
    "lora_kohya_map": Move("lora", "kohya_map"),
    "quant_factors": Move("quantisation", "factors", back=dict),
    "inference_quant_factors": Move("quantisation", "inference_factors", back=dict),
    "int8_dense_modules": Move("quantisation", "int8_dense_modules"),
    "inference_deny_lifted_by": Move("quantisation", "deny_lifted_by", back=dict),
    "text_encoder_quant_deny": Move("quantisation", "text_encoder_deny"),
    "prequantised_patterns": Move("quantisation", "prequantised_patterns"),
    "default_dense_base": Move("quantisation", "default_dense_base"),
    "single_file_markers": Move("single_file", "markers"),
    "single_file_whole_pipeline": Move("single_file", "whole_pipeline"),
    "single_file_parts": Move("single_file", "parts"),
    "gguf_refused_reason": Move("single_file", "gguf_refused_reason"),
    # Plugin API 1's loose fields, in plugin API 2's sections.
    "denoiser": Move("pipeline", "denoiser"),
    "denoiser_label": Move("pipeline", "denoiser_label"),
    "experts": Move("pipeline", "experts"),
    "guidance_kwarg": Move("pipeline", "guidance_kwarg"),
    "workflows": Move("pipeline", "workflows"),
    "controlnet_classes": Move("pipeline", "controlnet_classes"),
    "cache_context_pipelines": Move("pipeline", "cache_context_pipelines"),
    "compile_regions": Move("speed", "compile_regions"),
    "eager_fusions": Move("speed", "eager_fusions"),
    "optimization_deny": Move("speed", "optimization_deny"),
    "output": Move("rendering", "output"),
    "video": Move("rendering", "video"),
    "geometry": Move("rendering", "geometry"),
    "side_multiple": Move("rendering", "side_multiple"),
    "vae_decode_per_pixel": Move("rendering", "vae_decode_per_pixel"),
}
#: Flat fields whose one value became two or more section fields.
SPLIT: Mapping[str, str] = {
    "quant_deny": "quantisation=QuantRules(deny_inference=..., deny_training=...)",
    "fp16_compute_safe": "precision=PrecisionRules(fp16_unsafe=((\"denoiser\", REASON),))",
    "fp16_unsafe_reason": "precision=PrecisionRules(fp16_unsafe=((\"denoiser\", REASON),))",
}


def _register_rows() -> None:
    """Plugin API 0's spellings, one register row each (:mod:`engine.deprecation`)."""
    for name, move in RENAMED.items():
        register(f"FamilySpec({name}=...)", f"FamilySpec({move.section}={_section_class(move.section)}"
                 f"({move.field}=...))", kind="plugin")
        register(f"FamilySpec.{name}", f"FamilySpec.{move.section}.{move.field}", kind="plugin")
    register("FamilySpec(quant_deny={...})", SPLIT["quant_deny"], kind="plugin")
    register("FamilySpec(fp16_compute_safe=..., fp16_unsafe_reason=...)", SPLIT["fp16_compute_safe"], kind="plugin")
    register("FamilySpec.quant_deny", "FamilySpec.quantisation.deny(purpose)", kind="plugin")
    register("FamilySpec.fp16_compute_safe", "FamilySpec.precision.fp16_safe(component)", kind="plugin")
    register("FamilySpec.fp16_unsafe_reason", "FamilySpec.precision.fp16_reason(component)", kind="plugin")
    register("TrainingObjective(runtime_module=...)", "FamilySpec(runtime_module=...)", kind="plugin")
    register("TrainingObjective.runtime_module", "FamilySpec.runtime_module", kind="plugin")


def sections_from_legacy(current: dict[str, Any], legacy: Mapping[str, Any], *, family: str,
                         defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``FamilySpec`` fields with plugin API 0's flat ones folded into their sections
    (``defaults``: each section's default, as ``FamilySpec`` declares it).

    :raises TypeError: a name neither API knows (the registry reports it with the API versions).
    """
    unknown = [name for name in legacy if name not in RENAMED and name not in SPLIT]
    if unknown:
        raise TypeError(f"FamilySpec got unexpected keyword argument(s) {', '.join(map(repr, unknown))} "
                        f"(family {family!r})")
    updates: dict[str, dict[str, Any]] = {}
    for name, value in legacy.items():
        if name in RENAMED:
            move = RENAMED[name]
            deprecate(f"FamilySpec({name}=...)", stacklevel=5)
            updates.setdefault(move.section, {})[move.field] = move.convert(value) if move.convert else value
    if "quant_deny" in legacy:
        deprecate("FamilySpec(quant_deny={...})", stacklevel=5)
        mapping = dict(legacy["quant_deny"])
        updates.setdefault("quantisation", {}).update(
            deny_inference=tuple(mapping.get("inference", ())), deny_training=tuple(mapping.get("training", ())))
    if "fp16_compute_safe" in legacy or "fp16_unsafe_reason" in legacy:
        deprecate("FamilySpec(fp16_compute_safe=..., fp16_unsafe_reason=...)", stacklevel=5)
        if legacy.get("fp16_compute_safe", True) is False:
            reason = str(legacy.get("fp16_unsafe_reason") or "fp16 compute is unsafe for this family")
            updates["precision"] = {"fp16_unsafe": (("denoiser", reason),)}
    for section, fields in updates.items():
        base = current.get(section, defaults[section])
        current[section] = dataclasses.replace(base, **fields)
    return current


def _section_class(section: str) -> str:
    return {"training": "TrainingSpec", "lora": "LoraLayout", "quantisation": "QuantRules",
            "single_file": "SingleFileLayout", "precision": "PrecisionRules", "pipeline": "PipelineLayout",
            "speed": "SpeedRules", "rendering": "Rendering"}[section]


def legacy_read(spec: Any, name: str) -> Any:
    """A flat field of plugin API 0 read on a plugin API 1 ``FamilySpec`` (deprecated)."""
    if name in RENAMED:
        move = RENAMED[name]
        deprecate(f"FamilySpec.{name}")
        value = getattr(object.__getattribute__(spec, move.section), move.field)
        return move.back(value) if move.back else value
    if name == "quant_deny":
        deprecate("FamilySpec.quant_deny")
        rules = object.__getattribute__(spec, "quantisation")
        return {"inference": rules.deny_inference, "training": rules.deny_training}
    if name == "fp16_compute_safe":
        deprecate("FamilySpec.fp16_compute_safe")
        return object.__getattribute__(spec, "precision").fp16_safe()
    if name == "fp16_unsafe_reason":
        deprecate("FamilySpec.fp16_unsafe_reason")
        return object.__getattribute__(spec, "precision").fp16_reason()
    raise AttributeError(f"'FamilySpec' object has no attribute {name!r}")


_register_rows()


def declared_api(plugin: object) -> int | None:
    """The plugin API a plugin (module or object) says it targets, if it says."""
    value = getattr(plugin, DECLARATION, None)
    return value if isinstance(value, int) else None


def version_refusal(declared: int | None) -> str | None:
    """Why a plugin declaring ``declared`` cannot load here, or None."""
    if declared is None or OLDEST_SUPPORTED <= declared <= PLUGIN_API_VERSION:
        return None
    if declared > PLUGIN_API_VERSION:
        return (f"it targets plugin API {declared}; this diffusion-engine provides plugin API "
                f"{PLUGIN_API_VERSION}: upgrade diffusion-engine")
    return (f"it targets plugin API {declared}; this diffusion-engine reads plugin API "
            f"{OLDEST_SUPPORTED} to {PLUGIN_API_VERSION}: update the plugin ({MIGRATION_DOCS})")


def shape_refusal(declared: int | None, error: BaseException) -> str:
    """The message for a plugin whose objects no shim can read (a field removed, a type changed)."""
    written = f"plugin API {declared}" if declared is not None else "an API it does not declare"
    return (f"it was written for {written}; this diffusion-engine provides plugin API {PLUGIN_API_VERSION} "
            f"(and reads {OLDEST_SUPPORTED}'s spellings with warnings) but cannot read it: {error}. "
            f"Update the plugin ({MIGRATION_DOCS})")
