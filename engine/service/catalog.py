"""``engine.catalog``: what is installed, what a model reference is, what a family
needs on this machine, and the tiny builders.

None of these loads a model or touches the GPU; all of them are torch-free
except the tiny builders (they write real weights). The faces ask them here instead of
reaching into the registry or the preflight themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.contract.plugins import Registry
from engine.errors import EngineError
from engine.policy.info import images_info, training_info
from engine.policy.video_fit import clip_fit
from engine.requests.choices import TINY_DEFAULTS
from engine.service.machine import Machine

if TYPE_CHECKING:
    from engine.contract.types import FamilySpec
    from engine.hardware.profile import HardwareProfile
    from engine.policy.available import AvailableMemory


class Catalog:
    """``engine.catalog``: the installed families and plugins, and what a model reference is."""

    def __init__(self, registry: Registry, machine: Machine) -> None:
        self._registry = registry
        self._machine = machine

    def families(self) -> list[dict[str, object]]:
        """Every installed family: its names, checkpoints, and the plugin package that brought it."""
        rows = []
        for name, family in self._registry.families.items():
            owner = next((p for p in self._registry.plugins if name in p.families), None)
            rows.append({
                "name": family.name, "label": family.label, "aliases": list(family.aliases),
                "package": owner.package if owner else "?", "version": owner.version if owner else "",
                "plugin": owner.name if owner else "?", "checkpoints": [c.name for c in family.checkpoints],
                "output": family.rendering.output,  # images, or frames: a clip (what a face suggests writing)
            })
        return rows

    def family(self, name: str) -> dict[str, object]:
        """One family's row of :meth:`families`, by name or alias (``unknown_family`` otherwise)."""
        spec = self._registry.family(name)
        return next(row for row in self.families() if row["name"] == spec.name)

    def hook_implementations(self, hook: str) -> list[dict[str, object]]:
        """Which plugins implement ``hook``, in the order they are asked (``families --hook``)."""
        return self._registry.hook_implementations(hook)

    def plugins(self, *, builtin: bool = True) -> dict[str, list[dict[str, object]]]:
        """The plugins that loaded (the engine's own built-in one with ``builtin``) and those that failed."""
        return {
            "plugins": [
                {"name": p.name, "package": p.package, "version": p.version, "hooks": list(p.hooks),
                 "families": list(p.families), "builtin": p.builtin, "api": p.api,
                 "deprecations": list(p.deprecations)}
                for p in self._registry.plugins if builtin or not p.builtin
            ],
            "errors": [dict(e.__dict__) for e in self._registry.errors],
        }

    def info(self, family: str | None = None, *, model: str | None = None,
             base: str | None = None) -> dict[str, object]:
        """Each family's sizes and training options on this engine's machine (torch-free).

        ``family``: only that one. ``model``: only the family of that model
        reference (as :meth:`check_model` resolves it, downloading nothing), whose
        resolution is reported too."""
        checked = self.check_model(model, family=family, base=base) if model is not None else None
        if checked is not None:
            family = str(checked["family"])
        available = self._machine.available_memory()
        hardware = available.apply(self._machine.hardware())
        chosen = [self._registry.family(family)] if family else list(self._registry.families.values())
        return {
            "hardware": {**hardware.to_dict(), "capability_label": hardware.capability_label},
            "available_memory": available.to_dict(),
            "families": {
                f.name: {"images": images_info(self._registry, f).to_dict(),
                         "training": training_info(self._registry, f, hardware).to_dict(),
                         **({"video": self._clips_here(f, hardware, available)} if f.rendering.output == "frames" else {})}
                for f in chosen
            },
            **({"model": checked} if checked is not None else {}),
            "errors": [dict(e.__dict__) for e in self._registry.errors],
        }

    def _clips_here(self, family: FamilySpec, hardware: HardwareProfile,
                    available: AvailableMemory) -> dict[str, object]:
        """Video on this machine: each checkpoint's default clip planned here, and the longest
        clip that does better (:mod:`engine.policy.video_fit`)."""
        return {c.name: clip_fit(self._registry, family, c, hardware, available).to_dict()
                for c in family.checkpoints}

    @staticmethod
    def is_pipeline_folder(path: Path) -> bool:
        """Whether ``path`` is a diffusers pipeline folder (a classic or a modular index)."""
        from engine.preflight.pipeline_index import is_pipeline_folder

        return is_pipeline_folder(path)

    def check_model(self, reference: str, *, family: str | None = None,
                    base: str | None = None) -> dict[str, object]:
        """What a model reference resolves to, the same for every command and face.

        A local pipeline folder, a single file (with or without ``base``), a
        GGUF, a checkpoint name of any installed family (as `families` lists them) or a
        hub id: its kind, family, checkpoint and whether its weights are here
        (if not: the download a start would need, from the family's table).
        Reads headers and the hub cache only; downloads nothing."""
        from engine.preflight.hub import weights_report
        from engine.preflight.model import resolve_model  # a model's files are read where one is named

        source = resolve_model(self._registry, reference, family=family, base=base)
        return {
            "reference": reference, "kind": source.kind, "location": source.location,
            "family": source.family.name, "checkpoint": source.checkpoint.name if source.checkpoint else None,
            "base": source.base, "prequantised": source.prequantised_scheme,
            "weights": weights_report(source, self._registry.component_sizes(source.family, source.checkpoint)),
        }

    def tiny_pipeline(self, family: str, folder: str | Path, *, sdcpp: bool = False) -> Path:
        """Write ``family``'s tiny random-weight pipeline to ``folder`` (new or empty): a real
        diffusers folder to try every command on, offline, in seconds. ``sdcpp``: the files
        stable-diffusion.cpp reads instead (its table's ``sdcpp.tiny_files``); the model file
        is returned, its companions beside it."""
        spec = self._registry.family(family)
        if not sdcpp:
            built = Path(self._registry.build_tiny_pipeline(spec, _new_folder(Path(folder))))
            # Its own size, steps and clip: a request that names none (OpenAI's size="auto", a
            # videos.create with a prompt alone) stays tiny.
            from engine.preflight.folder import DEFAULTS_FILE

            defaults = {**TINY_DEFAULTS, **_tiny_clip(spec)}
            (built / DEFAULTS_FILE).write_text(json.dumps({"defaults": defaults}) + "\n", encoding="utf-8")
            return built
        if not spec.sdcpp.tiny_files:
            raise EngineError(f"{spec.label} has no tiny stable-diffusion.cpp files (its table's "
                              "sdcpp.tiny_files)", code="no_tiny_pipeline")
        import importlib

        module, _, name = spec.sdcpp.tiny_files.partition(":")
        written = getattr(importlib.import_module(module), name)(_new_folder(Path(folder)), gguf=True)
        return Path(next(iter(written.values())))

    def tiny_dataset(self, folder: str | Path, *, count: int = 4, size: int = 64) -> Path:
        """Write ``count`` drawn, captioned ``size`` px images to ``folder`` (new or empty): a dataset to train on."""
        if not 1 <= count <= 64:
            raise EngineError(f"count must be from 1 to 64 (got {count})", code="invalid_request")
        if not 16 <= size <= 1024:
            raise EngineError(f"size must be from 16 to 1024 (got {size})", code="invalid_request")
        from engine.service.tiny_dataset import write_dataset

        return Path(write_dataset(_new_folder(Path(folder)), count=count, size=size))


def _new_folder(folder: Path) -> Path:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise EngineError(f"{folder} already exists and is not an empty folder; give a new folder",
                          code="output_exists")
    return folder


def _tiny_clip(spec: FamilySpec) -> dict[str, int]:
    """A video family's tiny default clip: the shortest clip of more than one frame on its lattice."""
    video = spec.video_of(None) if spec.rendering.output == "frames" else None
    if video is None:
        return {}
    return {"frames": next(n for n in range(2, video.max_frames + 1) if video.in_range(n))}
