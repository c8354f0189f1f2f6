"""The HTTP API: FastAPI over one :class:`~engine.service.Engine`.

Routes mirror the Python facade (families, images info / plan / load /
generate / status / unload, training info / start / status / stop / runs),
plus an OpenAI-compatible ``POST /v1/images/generations`` on the loaded
pipeline, so existing clients work unchanged. Every error is JSON
``{"error": {"code", "message"}}`` with a stable code: 400 for a request that
cannot succeed here, 404 for an unknown name or path, 409 for a busy engine
or a missing prerequisite, 422 for a malformed body. Model, dataset and
output paths are confined to the configured roots; a bearer token, when set,
guards every route.
"""

from __future__ import annotations

import base64
import io
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine import __version__
from engine.errors import EngineError, UnknownName
from engine.policy.inference import InferenceRequest
from engine.server.paths import PathRefused, confine
from engine.service import Busy, Engine
from engine.training.config import InvalidConfig, TrainingConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NOT_FOUND = {"unknown_family", "unknown_preset", "unknown_checkpoint", "model_not_found", "dataset_not_found"}
CONFLICT = {"busy", "not_loaded", "not_training"}
UNPROCESSABLE = {"invalid_config", "invalid_request"}


@dataclass(frozen=True)
class ServerSettings:
    model_roots: tuple[Path, ...] = ()
    dataset_roots: tuple[Path, ...] = ()
    output_roots: tuple[Path, ...] = ()
    token: str | None = None
    #: Accept hub repo ids for models (the server may download them).
    allow_hub: bool = False
    extra: dict[str, str] = field(default_factory=dict)


# -- bodies --------------------------------------------------------------------


class PlanControls(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: str = "auto"
    quant: str = "auto"
    memory: str = "auto"
    attention: str = "auto"
    step_cache: str = "auto"
    compile: str = "auto"
    speed: str = "default"
    steps: int | None = Field(None, ge=1, le=1000)
    threads: int | None = Field(None, ge=1, le=1024)

    def request(self) -> InferenceRequest:
        return InferenceRequest(**self.model_dump(include=set(PlanControls.model_fields)))


class PlanBody(PlanControls):
    model: str | None = None
    family: str | None = None
    checkpoint: str | None = None
    base: str | None = None


class LoadBody(PlanControls):
    model: str
    family: str | None = None
    base: str | None = None


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(..., max_length=4000)
    negative_prompt: str | None = Field(None, max_length=4000)
    steps: int | None = Field(None, ge=1, le=200)
    guidance: float | None = Field(None, ge=0, le=50)
    width: int | None = Field(None, ge=16, le=4096, multiple_of=16)
    height: int | None = Field(None, ge=16, le=4096, multiple_of=16)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    count: int = Field(1, ge=1, le=8)


class StopBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    save: bool = True


class OpenAIImagesBody(BaseModel):
    """The OpenAI images API request; unknown fields are ignored as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(..., max_length=4000)
    n: int = Field(1, ge=1, le=8)
    size: str | None = Field("1024x1024", pattern=r"^\d{2,4}x\d{2,4}$")
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: str | None = None


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- the app -------------------------------------------------------------------


def create_app(engine: Engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    app = FastAPI(
        title="diffusion-engine",
        version=__version__,
        description="Run diffusion image models and train LoRA adapters, the fastest way this machine allows.",
        responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 422)},
    )
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    guard = [Depends(_token_guard(settings.token))]
    api = APIRouter(prefix="/v1", dependencies=guard)

    def model_path(value: str) -> str:
        if settings.allow_hub and _HUB_ID.match(value) and not Path(value).is_absolute():
            try:
                return str(confine(value, settings.model_roots, "model"))
            except PathRefused:
                return value
        return str(confine(value, settings.model_roots, "model"))

    @api.get("/families")
    def families() -> list[dict[str, Any]]:
        return engine.families()

    @api.get("/images/info")
    def images_info() -> dict[str, Any]:
        return engine.info()

    @api.post("/images/plan")
    def plan(body: PlanBody) -> dict[str, Any]:
        model = model_path(body.model) if body.model else None
        base = model_path(body.base) if body.base else None
        result = engine.plan(model, family=body.family, checkpoint=body.checkpoint, base=base, request=body.request())
        return result.to_dict()

    @api.post("/images/load")
    def load(body: LoadBody) -> dict[str, Any]:
        base = model_path(body.base) if body.base else None
        return engine.load(model_path(body.model), base=base, family=body.family, request=body.request())

    @api.post("/images/generate")
    def generate(body: GenerateBody) -> dict[str, Any]:
        started = time.perf_counter()
        images = engine.generate(**body.model_dump())
        return {"images": [_png_b64(i) for i in images], "seconds": round(time.perf_counter() - started, 3)}

    @api.get("/images/status")
    def status() -> dict[str, Any]:
        return engine.status()

    @api.post("/images/unload")
    def unload() -> dict[str, Any]:
        return {"unloaded": engine.unload()}

    @api.post("/images/generations")
    def openai_images(body: OpenAIImagesBody) -> dict[str, Any]:
        if body.response_format != "b64_json":
            raise EngineError("only response_format=b64_json is served (no image hosting)", code="invalid_request")
        width = height = None
        if body.size:
            width, height = (int(v) for v in body.size.split("x"))
            if width % 16 or height % 16:
                raise EngineError(f"size {body.size}: width and height must be multiples of 16", code="invalid_request")
        images = engine.generate(body.prompt, count=body.n, width=width, height=height, seed=secrets.randbelow(2**31))
        return {"created": int(time.time()), "data": [{"b64_json": _png_b64(i)} for i in images]}

    @api.get("/training/info")
    def training_info() -> dict[str, Any]:
        return engine.train_info()

    @api.post("/training/start")
    def start_training(body: TrainingConfig) -> dict[str, Any]:
        confined: dict[str, Any] = {
            "base_model": model_path(body.base_model),
            "dataset_dir": confine(str(body.dataset_dir), settings.dataset_roots, "dataset"),
        }
        if body.output_dir is not None:
            confined["output_dir"] = confine(str(body.output_dir), settings.output_roots, "output")
        return engine.start_training(body.model_copy(update=confined))

    @api.get("/training/status")
    def training_status() -> dict[str, Any]:
        return engine.training_status() or {"status": "idle"}

    @api.post("/training/stop")
    def stop_training(body: StopBody) -> dict[str, Any]:
        return engine.stop_training(save=body.save)

    @api.get("/training/runs")
    def runs() -> list[dict[str, Any]]:
        return engine.runs()

    app.include_router(api)
    return app


def _token_guard(token: str | None):  # type: ignore[no-untyped-def]
    def check(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise EngineError("missing or wrong bearer token", code="unauthorized")

    return check


def _status_for(error: EngineError) -> int:
    if error.code == "unauthorized":
        return 401
    if isinstance(error, Busy) or error.code in CONFLICT:
        return 409
    if isinstance(error, UnknownName) or error.code in NOT_FOUND:
        return 404
    if isinstance(error, InvalidConfig) or error.code in UNPROCESSABLE:
        return 422
    return 400


async def _engine_error(_: Request, error: EngineError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.code == "unauthorized" else None
    return JSONResponse({"error": error.to_dict()}, status_code=_status_for(error), headers=headers)


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in error.errors()
    )
    return JSONResponse({"error": {"code": "invalid_request", "message": problems}}, status_code=422)


def _png_b64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")

