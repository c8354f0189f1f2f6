"""A pipeline folder is the checkpoint its files say: its name only breaks ties.

A local two-expert folder named ``~/models/my-video-model`` is its family's two-expert
checkpoint because it holds a second denoiser (and its VAE's channels), not the family's
default because its name matches nothing: the trainer reads the folder's
``model_index.json`` so, and inference now does too. What the files say, cheaply, from the
index and the configs (no weight read):

- the two-expert layout (a second denoiser listed): a checkpoint with a low-noise expert's
  guidance (``Checkpoint.expert_guidance``) is one;
- the VAE's latent channels against the checkpoint's geometry (``latent_channels``, where the
  table gives it);
- the index's pipeline settings against the checkpoint's (``Checkpoint.index_settings``: a
  distilled checkpoint's ``is_distilled``).

Among the checkpoints of the folder's pipeline class that agree with every fact, the one its
name matches best; none agreeing: the name's (the table may not know this layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine import stored
from engine.contract.types import Checkpoint, FamilySpec


@dataclass(frozen=True)
class FolderLayout:
    """What a pipeline folder's files say about which checkpoint it is."""

    two_experts: bool
    #: The VAE's latent channels from its config (``z_dim`` / ``latent_channels``); None: unsaid.
    latent_channels: int | None
    #: The index's pipeline settings (its entries that name no component: ``is_distilled``, say).
    settings: Mapping[str, object] = field(default_factory=dict)


def folder_layout(folder: Path, spec: FamilySpec, components: Mapping[str, object],
                  entries: Mapping[str, object] | None = None) -> FolderLayout:
    """The folder's layout from its index (``components``: the listed, non-null ones; ``entries``:
    all of it, its pipeline settings among them) and VAE config."""
    experts = [name for name in spec.pipeline.experts if name in components]
    channels = None
    config = folder / "vae" / "config.json"
    if config.is_file():
        try:
            data = stored.read_json(config)
        except (OSError, ValueError):
            data = {}
        value = data.get("z_dim", data.get("latent_channels")) if isinstance(data, dict) else None
        channels = value if isinstance(value, int) and not isinstance(value, bool) else None
    settings = {key: value for key, value in (entries or {}).items()
                if not key.startswith("_") and not isinstance(value, list)}
    return FolderLayout(two_experts=bool(experts), latent_channels=channels, settings=settings)


def agrees(spec: FamilySpec, checkpoint: Checkpoint, layout: FolderLayout) -> bool:
    """Whether ``checkpoint`` is a checkpoint with this layout (facts the table leaves out agree)."""
    if spec.pipeline.experts and layout.two_experts != (checkpoint.expert_guidance is not None):
        return False
    wanted = spec.geometry_of(checkpoint).latent_channels
    if wanted and layout.latent_channels and wanted != layout.latent_channels:
        return False
    return all(layout.settings.get(key, value) == value for key, value in checkpoint.index_settings)


def checkpoint_by_files(spec: FamilySpec, named: Checkpoint | None, class_name: str,
                        layout: FolderLayout, name: str) -> Checkpoint | None:
    """The checkpoint the folder's files say it is (``named``: the one its name and class gave)."""
    if named is not None and agrees(spec, named, layout):
        return named
    fitting = [c for c in spec.checkpoints if spec.pipeline_class_of(c) == class_name and agrees(spec, c, layout)]
    if not fitting:
        return named
    return max(fitting, key=lambda c: c.match_score(name))
