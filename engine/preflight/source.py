"""What a model argument resolved to: the :class:`ModelSource` record and its refusals.

Kept apart from the resolution itself (:mod:`engine.preflight.model`) so the
runtime, the trainer and the hub checks can name the record without pulling
in the classifiers: every resolver module builds one of these, and the
loader reads one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.contract.types import BorrowedComponent, StoredLayout
from engine.policy.encoders import PrecastEncoders
from engine.policy.plan import ModelDefaults, ModelFacts
from engine.preflight.model_errors import ModelNotFound, NotAPipeline  # noqa: F401 - their home before, re-exported
from engine.preflight.sdcpp import sdcpp_files
from engine.contract.types import Checkpoint, ComponentSizes, FamilySpec

#: ``single_file_pipeline``: one ``.safetensors`` holding the whole pipeline
#: (its ``base`` is only where the component configs come from).
ModelKind = Literal["pipeline", "single_file", "single_file_pipeline", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """A model argument, classified and sized before anything loads: what the
    planner plans from (:meth:`facts`) and what the loader loads."""

    kind: ModelKind
    location: str
    family: FamilySpec
    checkpoint: Checkpoint | None
    #: The pipeline that provides configs and the other components
    #: (single-file and GGUF models); None for full pipelines and hub ids.
    base: str | None = None
    measured_sizes: ComponentSizes | None = None
    #: The denoiser's GB under each scheme, sized from its tensor shapes.
    scheme_gb: Mapping[str, float] | None = None
    gguf_gb: float | None = None
    prequantised_scheme: str | None = None
    #: (name, shape) of every denoiser tensor, from its safetensors headers
    #: (local pipelines and single files); empty where unread.
    denoiser_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: The text encoders' files are stored pre-cast (from their headers).
    precast_encoders: PrecastEncoders | None = None
    #: A pipeline folder's own size and steps (its ``diffusion_engine.json``).
    defaults: ModelDefaults = ModelDefaults()
    #: The publisher's layout a denoiser is stored in, converted on load (from its headers).
    stored_layout: StoredLayout | None = None
    #: Components the repo names without shipping, taken from the family's named repos.
    borrowed: tuple[BorrowedComponent, ...] = ()
    #: A single file's publisher's quantised format (``fp8_scaled``), from its header.
    upstream_format: str | None = None

    def facts(self, registry: Registry) -> ModelFacts:
        return ModelFacts(
            family=self.family,
            checkpoint=self.checkpoint,
            table_sizes=registry.component_sizes(self.family, self.checkpoint),
            measured_sizes=self.measured_sizes,
            measured_scheme_gb=self.scheme_gb,
            gguf_transformer_gb=self.gguf_gb,
            prequantised_scheme=self.prequantised_scheme,
            precast_encoders=self.precast_encoders,
            sdcpp=sdcpp_files(self.family, self.kind, self.location),
            defaults=self.defaults,
            stored_format=self.upstream_format,
            attention_heads=denoiser_heads(self.family, self.kind, self.location),
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "location": self.location,
            "family": self.family.name,
            "checkpoint": self.checkpoint.name if self.checkpoint else None,
            "base": self.base,
            "stored_format": self.upstream_format,
            "borrowed": {b.component: b.repo for b in self.borrowed} or None,
            "stored_layout": ({"name": self.stored_layout.name, "converted": self.stored_layout.note}
                              if self.stored_layout is not None else None),
        }


def denoiser_heads(family: FamilySpec, kind: ModelKind, location: str) -> int | None:
    """A pipeline folder's denoiser attention heads (its ``config.json``'s ``num_attention_heads``),
    what a context-parallel split divides; None elsewhere or where the config does not say."""
    if kind != "pipeline":
        return None
    from pathlib import Path

    from engine import stored

    folder = Path(location) / family.pipeline.denoiser
    try:
        heads = stored.read_json(folder / "config.json", root=folder).get("num_attention_heads")
    except (stored.UnreadableRecord, AttributeError):
        return None
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None


def unknown_family(registry: Registry, what: str) -> EngineError:
    """The refusal for a model whose family neither its files nor its name tell."""
    return EngineError(
        f"could not tell the model family of {what}; give family=NAME "
        f"({', '.join(registry.families)})",
        code="family_unknown",
    )
