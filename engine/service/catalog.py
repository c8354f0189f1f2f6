"""The questions half of :class:`engine.service.facade.Engine`: what is installed, what a model
reference is, what a family needs on this machine, and the tiny builders.

None of these loads a model or touches the GPU; all of them are torch-free
except :meth:`CatalogQuestions.doctor` (it probes with torch) and the tiny
builders (they write real weights). The faces ask them here instead of
reaching into the registry or the preflight themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.policy.info import images_info, training_info
from engine.requests.inference import InferenceRequest
from engine.preflight.model import resolve_model


class CatalogQuestions:
    """Light questions of :class:`~engine.service.facade.Engine` (a mixin: the engine holds the registry)."""

    # Provided by Engine.
    registry: Any
    hardware: Callable[..., Any]
    available_memory: Callable[..., Any]
    plan: Callable[..., Any]

    def check_generate(self, request: Any) -> None:
        """Refuse, before anything loads, a generate whose input images are missing,
        unreadable or beyond the caps (each named by its request field)."""
        for name in ("image", "mask_image", "control_image"):
            value = getattr(request, name)
            if value is not None:
                self.check_image(value, name)

    def check_image(self, value: Any, field: str) -> tuple[int, int]:
        """An input image's (width, height) from its header, within the engine's caps;
        nothing decoded, so a bomb is refused (``invalid_image``, naming ``field``) for nothing."""
        from engine.preflight.images import image_size

        return image_size(value, field)

    def plans(self, request: InferenceRequest = InferenceRequest()) -> dict[str, dict[str, object]]:
        """Each family's default checkpoint planned for this machine, or the refusal a
        load would give (``{"error": {"code", "message"}}``): why it cannot run here is an answer too."""
        answers: dict[str, dict[str, object]] = {}
        for name in self.registry.families:
            try:
                answers[name] = self.plan(family=name, request=request).to_dict()
            except EngineError as error:
                answers[name] = {"error": {"code": error.code, "message": error.message}}
        return answers


    def families(self) -> list[dict[str, object]]:
        """Every installed family: its names, checkpoints, and the plugin package that brought it."""
        rows = []
        for name, family in self.registry.families.items():
            owner = next((p for p in self.registry.plugins if name in p.families), None)
            rows.append({
                "name": family.name, "label": family.label, "aliases": list(family.aliases),
                "package": owner.package if owner else "?", "version": owner.version if owner else "",
                "plugin": owner.name if owner else "?", "checkpoints": [c.name for c in family.checkpoints],
            })
        return rows

    def family(self, name: str) -> dict[str, object]:
        """One family's row of :meth:`families`, by name or alias (``unknown_family`` otherwise)."""
        spec = self.registry.family(name)
        return next(row for row in self.families() if row["name"] == spec.name)

    def hook_implementations(self, hook: str) -> list[dict[str, object]]:
        """Which plugins implement ``hook``, in the order they are asked (``families --hook``)."""
        return self.registry.hook_implementations(hook)

    def plugins(self, *, builtin: bool = True) -> dict[str, list[dict[str, object]]]:
        """The plugins that loaded (the engine's own built-in one with ``builtin``) and those that failed."""
        return {
            "plugins": [
                {"name": p.name, "package": p.package, "version": p.version, "hooks": list(p.hooks),
                 "families": list(p.families), "builtin": p.builtin, "api": p.api,
                 "deprecations": list(p.deprecations)}
                for p in self.registry.plugins if builtin or not p.builtin
            ],
            "errors": [dict(e.__dict__) for e in self.registry.errors],
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
        available = self.available_memory()
        hardware = available.apply(self.hardware())
        chosen = [self.registry.family(family)] if family else list(self.registry.families.values())
        return {
            "hardware": {**hardware.to_dict(), "capability_label": hardware.capability_label},
            "available_memory": available.to_dict(),
            "families": {
                f.name: {"images": images_info(self.registry, f).to_dict(),
                         "training": training_info(self.registry, f, hardware).to_dict()}
                for f in chosen
            },
            **({"model": checked} if checked is not None else {}),
            "errors": [dict(e.__dict__) for e in self.registry.errors],
        }

    def check_model(self, reference: str, *, family: str | None = None,
                    base: str | None = None) -> dict[str, object]:
        """What a model reference resolves to, the same for every command and face.

        A local pipeline folder, a single file (with or without ``base``), a
        GGUF, a checkpoint name of any installed family (as `families` lists them) or a
        hub id: its kind, family, checkpoint and whether its weights are here
        (if not: the download a start would need, from the family's table).
        Reads headers and the hub cache only; downloads nothing."""
        from engine.preflight.hub import weights_report

        source = resolve_model(self.registry, reference, family=family, base=base)
        table_gb = self.registry.component_sizes(source.family, source.checkpoint).total_gb
        return {
            "reference": reference, "kind": source.kind, "location": source.location,
            "family": source.family.name, "checkpoint": source.checkpoint.name if source.checkpoint else None,
            "base": source.base, "prequantised": source.prequantised_scheme,
            "weights": weights_report(source, table_gb),
        }

    def tiny_pipeline(self, family: str, folder: str | Path, *, sdcpp: bool = False) -> Path:
        """Write ``family``'s tiny random-weight pipeline to ``folder`` (new or empty): a real
        diffusers folder to try every command on, offline, in seconds. ``sdcpp``: the files
        stable-diffusion.cpp reads instead (its table's ``sdcpp.tiny_files``); the model file
        is returned, its companions beside it."""
        spec = self.registry.family(family)
        if not sdcpp:
            return Path(self.registry.build_tiny_pipeline(spec, _new_folder(Path(folder))))
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
        from engine.testing.datasets import write_dataset

        return Path(write_dataset(_new_folder(Path(folder)), count=count, size=size))

    def doctor(self, *, as_json: bool = False) -> str:
        """Versions, then one verdict per family for inference and training (probes with torch)."""
        from engine.service.doctor import run_doctor

        return run_doctor(self, as_json=as_json)

    def images_info(self) -> dict[str, object]:
        """Each family's component sizes and resident GB per scheme, from the
        tables alone: torch-free (the machine from the light probe, never the
        torch-verified one), so a panel can show the trade-off before loading."""
        return {
            "hardware": self.hardware(verify=False).to_dict(),
            "families": {f.name: images_info(self.registry, f).to_dict() for f in self.registry.families.values()},
        }

    def train_info(self, *, device: str = "auto") -> dict[str, object]:
        """Per family: the base precisions a run offers here on ``device`` (auto, cuda, cpu),
        and why each other one is not offered (the Train page reads it for its Device choice)."""
        from engine.policy.training import DEVICES

        if device not in DEVICES:
            raise EngineError(f"device must be one of {', '.join(DEVICES)} (got {device!r})", code="invalid_request")
        hardware = self.available_memory().apply(self.hardware())
        return {f.name: training_info(self.registry, f, hardware, device=device).to_dict()  # type: ignore[arg-type]
                for f in self.registry.families.values()}


def _new_folder(folder: Path) -> Path:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise EngineError(f"{folder} already exists and is not an empty folder; give a new folder",
                          code="output_exists")
    return folder
