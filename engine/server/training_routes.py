"""The training routes: info, the dry run, start, status, stop, cancel and the runs.

Each translates its body into the facade's call (``engine.training``), the
paths confined to the server's roots by :class:`~engine.server.confined.Confined`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine import Engine
from engine.server.bodies import StopBody, TrainingStartBody
from engine.server.confined import Confined


def training_router(engine: Engine, confined: Confined) -> APIRouter:
    api = APIRouter(prefix="/v1/training")

    @api.get("/info")
    def training_info(device: str = "auto", base_model: str | None = None,
                      resolution: int | None = None) -> dict[str, Any]:
        """Per family, the base precisions a run offers on ``device`` (auto, cuda, cpu), the others
        with why; with ``base_model`` (under the model roots) and ``resolution``, that base's family
        sized as a run on it would be."""
        base = confined.optional_model(base_model)
        return engine.training.info(device=device, base_model=base, resolution=resolution)

    @api.post("/start")
    def start_training(body: TrainingStartBody) -> dict[str, Any]:
        return engine.training.start(confined.training(body), resume=body.resume)

    @api.post("/plan")
    def plan_training(body: TrainingStartBody) -> dict[str, Any]:
        """The dry run: every check a start makes (memory, dataset, precision), loading and evicting nothing."""
        return engine.training.plan(confined.training(body)).to_dict()

    @api.get("/status")
    def training_status() -> dict[str, Any]:
        return engine.training.status() or {"status": "idle"}

    @api.post("/stop")
    def stop_training(body: StopBody) -> dict[str, Any]:
        return engine.training.stop(save=body.save, now=body.now)

    @api.post("/cancel")
    def cancel_training() -> dict[str, Any]:
        return engine.training.cancel()

    @api.get("/runs")
    def runs() -> list[dict[str, Any]]:
        return engine.training.runs()

    return api
