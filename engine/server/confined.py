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
from engine.errors import EngineError
from engine.requests import GenerateBody, LoraBody
from engine.server.bodies import TrainingStartBody
from engine.server.paths import confine, confine_model
from engine.server.settings import ServerSettings

#: The generate body's fields that name input images (confined to the input roots here).
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

    def request_model(self, value: str | None) -> str | None:
        """A request's ``model``: None where it means the loaded model (none given, a name the
        loaded model answers to, OpenAI's own names), else the model confined to the roots."""
        if self.engine.loaded.means(value):
            return None
        if self.settings.replica:  # a replicated service serves its --load model on every replica
            raise EngineError(f"model {value[:120]!r} is not the model this replicated service serves: its replicas "  # type: ignore[index]
                              "serve their --load model and never switch; drop model, or serve that model",
                              code="not_with_replicas")
        return self.model(value)  # type: ignore[arg-type]

    def optional_model(self, value: str | None) -> str | None:
        return self.model(value) if value else None

    def lora_bodies(self, bodies: list[LoraBody] | None) -> list[LoraBody] | None:
        """Each LoRA's path confined to the LoRA roots (None: keep the loaded ones)."""
        if bodies is None:
            return None
        return [b.model_copy(update={"path": str(confine(b.path, self.settings.lora_roots, "LoRA"))}) for b in bodies]

    def loras(self, bodies: list[LoraBody] | None) -> list[dict[str, object]] | None:
        """The confined LoRAs as :meth:`engine.images.load` takes them."""
        confined = self.lora_bodies(bodies)
        return None if confined is None else [{"path": b.path, "scale": b.scale, "partial": b.partial} for b in confined]

    def controlnet(self, value: str | None) -> str | None:
        return str(confine(value, self.settings.model_roots, "ControlNet")) if value else None

    def generate(self, body: GenerateBody) -> GenerateBody:
        """The body with its input images confined to the input roots, its LoRAs confined, and
        its model confined unless it names the loaded one; the queue's ticket then sizes the
        images from their headers (a bomb is refused before it is queued or decoded)."""
        update: dict[str, Any] = {"loras": self.lora_bodies(body.loras), "model": self.request_model(body.model)}
        for name in INPUT_IMAGES:
            value = getattr(body, name)
            if isinstance(value, list):  # a multi-image edit's inputs
                update[name] = [str(confine(each, self.settings.input_roots, "input image")) for each in value]
            elif value is not None:
                update[name] = str(confine(value, self.settings.input_roots, "input image"))
        return body.model_copy(update=update)

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
