"""``POST /v1/models/quantize``: the server's face of ``Engine.quantize``.

The model is confined to the model roots and the output to the output roots,
like every path a body names; the engine's own checks (scheme, hardware, an
empty output) run before any weight is read, and the job holds the slot.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field

from engine import Engine
from engine.server.bodies import Body
from engine.server.confined import Confined
from engine.server.paths import confine


class QuantizeBody(Body):
    """A pipeline folder to store quantised, where, and for which device."""

    model: str = Field(..., min_length=1, max_length=4096)
    scheme: Literal["int8", "fp8"]
    output: str = Field(..., min_length=1, max_length=4096)
    device: Literal["auto", "cpu", "cuda"] = "auto"


def models_router(engine: Engine, confined: Confined) -> APIRouter:
    api = APIRouter(prefix="/v1/models")

    @api.post("/quantize")
    def quantize(body: QuantizeBody) -> dict[str, Any]:
        output = confine(body.output, confined.settings.output_roots, "output")
        return engine.quantize(confined.model(body.model), body.scheme, output, device=body.device)

    return api
