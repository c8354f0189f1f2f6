"""Components a family's repos name without shipping, and where they come from.

Some repos list an encoder in their ``model_index.json`` without its files (a gated model
the publisher leaves to the user); diffusers then fails at load, after a
resident model was evicted. The family names an ungated repo holding each such component
(``PipelineLayout.borrowed``): a folder that has the component uses its own, one that lacks it
takes it from that repo, which must be in the hub cache, or downloadable with consent, before
anything is evicted; otherwise the load is refused naming what is missing and from where.
"""

from __future__ import annotations

from pathlib import Path

from engine.contract.types import BorrowedComponent, FamilySpec
from engine.errors import PreflightError
from engine.preflight.hub import cached_file, hub_gate_error, hub_offline
from engine.preflight.source import ModelSource
from engine.requests.references import ALLOW_DOWNLOAD_ENV


def lacking(family: FamilySpec, folder: Path | None) -> tuple[BorrowedComponent, ...]:
    """The family's borrowed components that ``folder`` lacks (every one for a hub repo: None)."""
    return tuple(b for b in family.pipeline.borrowed if folder is None or not (folder / b.component).is_dir())


def borrowed_gb(borrowed: tuple[BorrowedComponent, ...]) -> float:
    """bf16 GB the lacking components add: from their files' headers where the hub cache holds
    their repo, else the family's figure (``BorrowedComponent.gb``)."""
    from engine.preflight.headers import dense_gb, tensor_shapes

    total = 0.0
    for component in borrowed:
        config = cached_file(component.repo, "config.json") if component.gb else None
        files = sorted(Path(config).parent.glob("*.safetensors")) if config else []
        total += dense_gb(tensor_shapes(files)) if files else component.gb
    return total


def borrowed_access_error(source: ModelSource, *, allow_download: bool) -> PreflightError | None:
    """Why a component ``source`` lacks cannot be had from its repo now, or None (as
    :func:`engine.preflight.hub.hub_access_error` judges a model's own repo)."""
    location, family, borrowed = source.location, source.family, source.borrowed

    for repo in dict.fromkeys(b.repo for b in borrowed):
        if cached_file(repo, "config.json") is not None:
            continue
        names = " and ".join(b.component for b in borrowed if b.repo == repo)
        what = (f"{location} has no {names}: {family.label}'s repos name it without shipping it, and the "
                f"engine takes it from {repo}")
        fix = f"download it (hf download {repo}) or copy its files into {Path(location) / names.split(' and ')[0]}"
        if hub_offline():
            return PreflightError(f"{what}, which is not in the local hub cache and the hub is offline "
                                  f"(HF_HUB_OFFLINE); {fix}", code="component_missing")
        if not allow_download:
            return PreflightError(f"{what}, which is not in the local hub cache: loading downloads it. Allow that "
                                  f"with --allow-download (or {ALLOW_DOWNLOAD_ENV}=1), or {fix}",
                                  code="download_not_allowed")
        gated = hub_gate_error(repo)
        if gated is not None:
            return gated
    return None
