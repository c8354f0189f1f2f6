"""What a request body names, confined to the server's roots.

Every route that takes a path (a model, a base, a LoRA, a ControlNet, an
input image, a dataset, an output folder or a checkpoint to resume) passes
it through one :class:`Confined` built from the settings, so a path outside
the configured roots is refused the same way on every route, before
anything is queued, loaded or evicted.
"""

from __future__ import annotations

from typing import Any

from engine import Engine
from engine.requests import GenerateBody, LoraBody
from engine.server.bodies import TrainingStartBody
from engine.server.paths import confine, confine_model
from engine.server.settings import ServerSettings

#: The generate options that name input images (sized from their headers here).
INPUT_IMAGES = ("image", "mask_image", "control_image")


class Confined:
    """The server's roots, applied to the paths in a body."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.checkpoint_names = frozenset(
            str(name).lower() for family in engine.catalog.families()
            for name in family["checkpoints"]  # type: ignore[attr-defined]
        )

    def model(self, value: str) -> str:
        """A model folder, file or (when the hub is allowed) repo id, or a known checkpoint name."""
        settings = self.settings
        return confine_model(value, settings.model_roots, allow_hub=settings.allow_hub,
                             checkpoint_names=self.checkpoint_names)

    def optional_model(self, value: str | None) -> str | None:
        return self.model(value) if value else None

    def loras(self, bodies: list[LoraBody] | None) -> list[dict[str, object]] | None:
        if bodies is None:
            return None
        return [{"path": str(confine(b.path, self.settings.lora_roots, "LoRA")), "scale": b.scale} for b in bodies]

    def controlnet(self, value: str | None) -> str | None:
        return str(confine(value, self.settings.model_roots, "ControlNet")) if value else None

    def inputs(self, options: dict[str, Any]) -> dict[str, Any]:
        """Image paths confined to the input roots and sized from their headers
        (a bomb is refused before it is queued or decoded); unset lists dropped."""
        for name in INPUT_IMAGES:
            if options.get(name) is not None:
                options[name] = str(confine(options[name], self.settings.input_roots, "input image"))
                self.engine.images.check_image(options[name], name)
        return {k: v for k, v in options.items() if not (k in ("seeds", "prompts", "batch") and v is None)}

    def generate(self, body: GenerateBody) -> dict[str, Any]:
        """A generate body as the engine's options, its paths confined (blocking: run it off the loop)."""
        return {**self.inputs(body.model_dump(exclude={"prompt", "loras"})), "loras": self.loras(body.loras)}

    def training(self, body: TrainingStartBody) -> Any:
        """A training body as a config, its base, dataset, output and checkpoint confined."""
        settings = self.settings
        confined: dict[str, Any] = {
            "base_model": self.model(body.base_model),
            "dataset_dir": confine(str(body.dataset_dir), settings.dataset_roots, "dataset"),
        }
        if body.output_dir is not None:
            confined["output_dir"] = confine(str(body.output_dir), settings.output_roots, "output")
        if body.resume_from is not None:  # a checkpoint of a run: runs live under the output roots
            confined["resume_from"] = confine(str(body.resume_from), settings.output_roots, "output")
        return body.config(**confined)
