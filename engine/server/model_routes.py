"""``GET /v1/models`` (OpenAI's model list) and ``POST /v1/models/quantize`` (``Engine.quantize``).

The list holds the loaded model and the models under the model roots, each by the id a
request's ``model`` field takes (a folder's or file's name in its root), so an OpenAI
client can list them and name one; naming one that is not loaded loads it first.

The model is confined to the model roots and the output to the output roots,
like every path a body names; the engine's own checks (scheme, hardware, an
empty output) run before any weight is read, and the job holds the slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field

from engine import Engine
from engine.server.bodies import Body
from engine.server.browse import listed_models
from engine.server.confined import Confined
from engine.server.paths import confine


class QuantizeBody(Body):
    """A pipeline folder to store quantised, where, and for which device."""

    model: str = Field(..., min_length=1, max_length=4096)
    scheme: Literal["int8", "int8_convrot", "fp8"]
    output: str = Field(..., min_length=1, max_length=4096)
    device: Literal["auto", "cpu", "cuda"] = "auto"


def models_router(engine: Engine, confined: Confined) -> APIRouter:
    api = APIRouter(prefix="/v1/models")

    @api.get("")
    def listing() -> dict[str, Any]:
        """OpenAI's model list: ``{"object": "list", "data": [{"id", "object", "created",
        "owned_by", "loaded", "family", "kind"}]}``, the loaded model first."""
        loaded: Any = engine.status().get("pipeline")
        location = loaded["model"]["location"] if isinstance(loaded, dict) else None
        data = [{"id": entry["name"], "object": "model", "created": entry["created"], "owned_by": "local",
                 "loaded": entry["path"] == location, "family": entry["family"], "kind": entry["kind"]}
                for root in confined.settings.model_roots for entry in listed_models(engine, Path(root))]
        if location is not None and not any(item["loaded"] for item in data):  # loaded from elsewhere
            data.append({"id": Path(location).name, "object": "model", "created": 0, "owned_by": "local",
                         "loaded": True, "family": loaded["model"]["family"], "kind": loaded["model"]["kind"]})
        data.sort(key=lambda item: not item["loaded"])
        return {"object": "list", "data": data}

    @api.post("/quantize")
    def quantize(body: QuantizeBody) -> dict[str, Any]:
        output = confine(body.output, confined.settings.output_roots, "output")
        return engine.quantize(confined.model(body.model), body.scheme, output, device=body.device)

    return api
