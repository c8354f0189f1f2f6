"""The HTTP API on a real loopback server: OpenAI client, confinement, token, fuzzing, a killed trainer."""

from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from engine.hardware.probe import probe
from engine.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service import Engine
from engine.testing.datasets import write_dataset
from tests.support import LiveServer

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Roots:
    def __init__(self, base: Path) -> None:
        self.models, self.datasets, self.outputs, self.outside = (base / n for n in ("models", "datasets", "outputs", "outside"))
        for folder in (self.models, self.datasets, self.outputs, self.outside):
            folder.mkdir(parents=True)


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]
) -> Iterator[tuple[str, Engine, Roots, "HostModel"]]:
    roots = Roots(tmp_path_factory.mktemp("server"))
    shutil.copytree(tiny_pipeline("sdxl"), roots.models / "tiny-sdxl")
    write_dataset(roots.datasets / "shapes", count=2)
    # Real data outside the roots, and a symlink inside that leads to it.
    shutil.copytree(tiny_pipeline("sdxl"), roots.outside / "sdxl")
    write_dataset(roots.outside / "data", count=2)
    (roots.datasets / "escape").symlink_to(roots.outside / "data")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=roots.outputs)
    host = HostModel(engine)
    settings = ServerSettings(
        model_roots=(roots.models,), dataset_roots=(roots.datasets,), output_roots=(roots.outputs,), token=TOKEN
    )
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, roots, host


class HostModel:
    def __init__(self, engine: Engine) -> None:
        self.evicted = 0
        engine.register_resident("host.llm", self.evict)

    def evict(self) -> None:
        self.evicted += 1


def test_server_binds_loopback(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, *_ = served
    assert url.startswith("http://127.0.0.1:")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_missing_or_wrong_token_is_refused(served: tuple[str, Engine, Roots, HostModel], headers: dict[str, str]) -> None:
    url, *_ = served
    response = httpx.get(f"{url}/v1/families", headers=headers)
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{url}/v1/families", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dataset_dir", "../outside/data"),  # traversal
        ("dataset_dir", "ABSOLUTE_OUTSIDE"),  # absolute path elsewhere
        ("dataset_dir", "escape"),  # a symlink inside that leads out
        ("base_model", "../outside/sdxl"),
        ("base_model", "ABSOLUTE_OUTSIDE_MODEL"),
        ("output_dir", "../outside/runs"),
    ],
)
def test_paths_outside_the_roots_are_refused_before_anything_is_read(
    served: tuple[str, Engine, Roots, HostModel], field: str, value: str
) -> None:
    url, engine, roots, host = served
    value = value.replace("ABSOLUTE_OUTSIDE_MODEL", str(roots.outside / "sdxl")).replace(
        "ABSOLUTE_OUTSIDE", str(roots.outside / "data")
    )
    # Everything else is valid: only the confinement can refuse this start.
    body = {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "resolution": 64, "steps": 2, "device": "cpu", field: value}
    before = host.evicted
    response = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "path_outside_roots"
    assert host.evicted == before and engine.training_status() is None
    assert not list((roots.outside).glob("runs*"))


def test_model_paths_are_confined_for_load_and_plan(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, _, roots, host = served
    before = host.evicted
    for route in ("/v1/images/load", "/v1/images/plan"):
        response = httpx.post(f"{url}{route}", json={"model": str(roots.outside / "sdxl")}, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["code"] == "path_outside_roots"
    assert host.evicted == before


def test_errors_map_to_status_codes(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, *_ = served
    plan = httpx.post(f"{url}/v1/images/plan", json={"family": "sd15"}, headers=AUTH)
    assert plan.status_code == 404 and plan.json()["error"]["code"] == "unknown_family"
    bad = httpx.post(f"{url}/v1/images/plan", json={"family": "flux", "speed": "warp"}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    stop = httpx.post(f"{url}/v1/training/stop", json={}, headers=AUTH)
    assert stop.status_code == 409 and stop.json()["error"]["code"] == "not_training"
    malformed = httpx.post(f"{url}/v1/images/generate", json={"prompt": 3, "count": 99}, headers=AUTH)
    assert malformed.status_code == 422 and malformed.json()["error"]["code"] == "invalid_request"
    plan = httpx.post(f"{url}/v1/images/plan", json={"family": "sdxl"}, headers=AUTH).json()
    assert set(plan["resolved"]) >= {"dtype", "transformer_quant", "memory_mode", "step_cache"}
    assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "diffusion-engine"


@pytest.mark.slow
def test_openai_client_generates_an_image_through_the_server(served: tuple[str, Engine, Roots, HostModel]) -> None:
    from openai import OpenAI

    url, engine, _, host = served
    loaded = httpx.post(f"{url}/v1/images/load", json={"model": "tiny-sdxl"}, headers=AUTH, timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["gpu_owner"] == "engine.pipeline"
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    result = client.images.generate(model="tiny-sdxl", prompt="a red fox", n=2, size="64x64", response_format="b64_json")
    images = [Image.open(io.BytesIO(base64.b64decode(item.b64_json))) for item in result.data]
    assert [image.size for image in images] == [(64, 64), (64, 64)]
    generated = httpx.post(f"{url}/v1/images/generate", json={"prompt": "x", "steps": 2, "width": 64, "height": 64}, headers=AUTH, timeout=120)
    assert generated.status_code == 200 and len(generated.json()["images"]) == 1
    assert httpx.post(f"{url}/v1/images/unload", headers=AUTH).json() == {"unloaded": True}


@pytest.mark.slow
def test_trainer_killed_while_serving_fails_cleanly_and_the_next_start_works(
    served: tuple[str, Engine, Roots, HostModel],
) -> None:
    url, engine, _, _ = served
    body = {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "resolution": 64, "steps": 100_000,
            "lora_rank": 2, "device": "cpu"}
    started = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH, timeout=60)
    assert started.status_code == 200, started.text
    busy = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH, timeout=60)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy"
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/training/status", headers=AUTH).json().get("step", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(engine._run.pid, signal.SIGKILL)  # noqa: SLF001 - the OOM killer's part
    while (status := httpx.get(f"{url}/v1/training/status", headers=AUTH).json())["status"] != "failed":
        assert time.monotonic() < deadline + 60
        time.sleep(0.1)
    assert status["error"]["code"] == "trainer_died"
    while httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["gpu_owner"] is not None:
        assert time.monotonic() < deadline + 60
        time.sleep(0.05)
    runs = httpx.get(f"{url}/v1/training/runs", headers=AUTH).json()
    assert runs[0]["status"] == "failed"
    again = httpx.post(f"{url}/v1/training/start", json={**body, "steps": 2}, headers=AUTH, timeout=60)
    assert again.status_code == 200, again.text
    assert engine.wait_training(timeout=300).status == "completed"


def test_serve_command_binds_loopback_and_requires_its_token(tmp_path: Path) -> None:
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", "0", "--token", "cli-token",
         "--models", str(tmp_path), "--outputs", str(tmp_path / "runs")],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()  # type: ignore[union-attr]
            if "running on" in line.lower():
                url = line.split("running on ")[1].split()[0]
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/v1/families").status_code == 401
        families = httpx.get(f"{url}/v1/families", headers={"Authorization": "Bearer cli-token"})
        assert {f["name"] for f in families.json()} >= {"flux", "sdxl"}
    finally:
        process.terminate()
        process.wait(timeout=10)
