"""An idle model goes: ``serve --keep-alive SECONDS`` unloads a pipeline nobody used for that long.

A real server on loopback and a tiny pipeline: the status says since when the
model is loaded and until when it stays; a generate restarts the clock; once
it runs out the model is unloaded and its memory given back. Short timeouts.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer

AUTH = {"Authorization": "Bearer keep-token"}


def _wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether ``condition`` came true within ``seconds`` (a bound for a failure only: a busy
    machine only makes a passing wait longer)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.slow
def test_an_idle_server_frees_its_model_after_keep_alive(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    shutil.copytree(tiny_pipeline("sdxl"), tmp_path / "models" / "sdxl")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    settings = ServerSettings(model_roots=(tmp_path / "models",), token="keep-token", keep_alive_s=3.0)
    with LiveServer(create_app(engine, settings)) as url:
        def call(method: str, path: str, **kwargs: object) -> httpx.Response:
            return httpx.request(method, f"{url}/v1/images{path}", headers=AUTH, timeout=120, **kwargs)  # type: ignore[arg-type]

        assert call("POST", "/load", json={"model": str(tmp_path / "models" / "sdxl")}).status_code == 200
        clock = call("GET", "/status").json()["pipeline"]["keep_alive"]
        assert clock["seconds"] == 3.0 and clock["loaded_since"] and clock["until"]
        time.sleep(1.6)
        generated = call("POST", "/generate", json={"prompt": "a fox", "steps": 1, "width": 64, "height": 64})
        assert generated.status_code == 200, generated.text
        time.sleep(1.6)  # 3.2 s since the load, 1.6 since the generate restarted the clock: still loaded
        assert call("GET", "/status").json()["pipeline"] is not None
        assert _wait_for(lambda: engine.images.session is None, 120.0), "the idle model was not unloaded"
        assert call("GET", "/status").json()["pipeline"] is None
        assert engine.residency.owner is None  # its memory was given back


def test_keep_alive_never_pulls_a_model_from_under_a_running_generate(tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    engine.images.keep_alive.seconds = 0.2
    engine.images.load(str(tiny_pipeline("sdxl")))
    started = time.monotonic()
    images = engine.images.generate("a fox", steps=8, width=64, height=64,
                                    progress=lambda step, total: time.sleep(0.1))  # slower than the clock
    assert images and time.monotonic() - started > 0.2  # it outlived the clock and finished
    assert _wait_for(lambda: engine.images.session is None, 120.0)


@pytest.mark.parametrize("seconds", [-1.0, float("inf")])
def test_a_keep_alive_that_means_nothing_is_refused(seconds: float) -> None:
    from engine.errors import EngineError

    with pytest.raises(EngineError, match="--keep-alive"):
        ServerSettings(keep_alive_s=seconds)


@pytest.mark.slow
def test_a_request_says_how_long_the_model_stays(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    """``keep_alive`` on a generate (native and OpenAI), as Ollama's: the model goes that long after it,
    on a server that otherwise keeps it; a negative or unbounded one is a 422."""
    shutil.copytree(tiny_pipeline("sdxl"), tmp_path / "models" / "sdxl")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=tmp_path / "runs")
    settings = ServerSettings(model_roots=(tmp_path / "models",), token="keep-token")
    with LiveServer(create_app(engine, settings)) as url:
        def post(path: str, body: dict[str, object]) -> httpx.Response:
            return httpx.post(f"{url}/v1{path}", json=body, headers=AUTH, timeout=120)

        assert post("/images/load", {"model": str(tmp_path / "models" / "sdxl")}).status_code == 200
        base = {"prompt": "a fox", "steps": 1, "width": 64, "height": 64}
        assert post("/images/generate", base).status_code == 200
        time.sleep(0.5)
        assert engine.images.session is not None  # no keep-alive anywhere: it stays
        assert post("/images/generate", {**base, "keep_alive": -1}).status_code == 422
        assert post("/images/generations", {"prompt": "a fox", "size": "64x64", "keep_alive": 0.3}).status_code == 200
        assert _wait_for(lambda: engine.images.session is None, 120.0), "keep_alive=0.3 did not unload the model"
