"""A running job: a cancel frees the engine within a block, not a step (through Python,
``DELETE /v1/videos/{id}`` on a real loopback server, and Ctrl-C on a ``serve`` process that is
rendering), and the status says the job is loading its model while it does.

A step of a real video denoiser runs for minutes; these tests watch the tiny Wan's blocks run
(forward hooks counting them) and assert that none runs after the cancel but the one under way."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.contract.plugins import load_registry
from engine.errors import Cancelled
from engine.hardware.probe import probe
from engine.requests import GenerateBody
from engine.runtime.interrupt import blocks_of
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer

TOKEN = "cancel-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_compiled_block_keeps_no_cancel_hook() -> None:
    """Hooking a compiled block would make torch recompile it; it is left to the step's end."""

    class Pipe:
        def __init__(self) -> None:
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
            self.components = {"transformer": torch.nn.Module(), "scheduler": object()}
            self.components["transformer"].blocks = self.blocks  # type: ignore[union-attr]

    pipe = Pipe()
    assert [name for name, _ in blocks_of(pipe)] == ["transformer.blocks.0", "transformer.blocks.1"]
    pipe.blocks[1].compile()  # lazy: nothing compiles until it runs
    assert [name for name, _ in blocks_of(pipe)] == ["transformer.blocks.0"]


@pytest.fixture(scope="module")
def wan(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def loaded(wan: Path) -> Iterator[Engine]:
    with Engine(registry=load_registry(), hardware=probe(verify=False)) as engine:
        engine.images.load(str(wan))
        yield engine


class Watched:
    """Counts a module's forward calls; ``then`` runs after the first (a cancel arriving mid-step)."""

    def __init__(self, module: torch.nn.Module, then: Callable[[], None] | None = None) -> None:
        self.calls = 0
        self._then = then
        self._handle = module.register_forward_hook(self._ran)

    def _ran(self, *_: Any) -> None:
        self.calls += 1
        if self.calls == 1 and self._then is not None:
            self._then()

    def remove(self) -> None:
        self._handle.remove()


def cancelled_inside(engine: Engine, first_module: torch.nn.Module, later_module: torch.nn.Module,
                     body: GenerateBody, match: str) -> tuple[Watched, Watched, list[int]]:
    """Render ``body`` with a cancel arriving as ``first_module`` finishes, refused as ``match``
    says: both modules' watches and the steps the render reported."""
    cancel = threading.Event()
    first, later = Watched(first_module, then=cancel.set), Watched(later_module)
    steps: list[int] = []
    try:
        with pytest.raises(Cancelled, match=match):
            engine.videos.generate(body, progress=lambda done, _total: steps.append(done), cancel=cancel)
    finally:
        first.remove(), later.remove()
    return first, later, steps


@pytest.mark.slow
def test_a_cancel_stops_inside_a_step_before_the_next_block(loaded: Engine) -> None:
    blocks = loaded.images.session.pipeline.transformer.blocks  # type: ignore[union-attr]
    body = GenerateBody(prompt="a fox", frames=9, steps=3, width=64, height=64)
    first, second, steps = cancelled_inside(loaded, blocks[0], blocks[1], body,
                                            r"inside a step \(before transformer\.blocks\.1")
    assert (first.calls, second.calls, steps) == (1, 0, [])  # the first step stopped after its first block
    assert not any(block._forward_pre_hooks for block in blocks)  # the cancel checks went with the call
    clip = loaded.videos.generate(GenerateBody(prompt="a fox", frames=5, steps=1, width=64, height=64))  # free
    assert len(clip.frames) == 5


@pytest.mark.slow
def test_a_cancel_stops_the_tiled_decode_between_its_blocks(loaded: Engine) -> None:
    """Every step done, then the cancel arrives in the first tile of the decode: the rest of the
    decoder never runs (a long clip's tiled decode is minutes on its own)."""
    pipe = loaded.images.session.pipeline  # type: ignore[union-attr]
    pipe.vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                           tile_sample_stride_height=16, tile_sample_stride_width=16)
    up = pipe.vae.decoder.up_blocks
    try:
        body = GenerateBody(prompt="a fox", frames=5, steps=2, width=64, height=64)
        first, last, steps = cancelled_inside(loaded, up[0], up[-1], body,
                                              r"before vae\.decoder\.up_blocks\.1")
    finally:
        pipe.vae.disable_tiling()
    assert steps == [1, 2] and (first.calls, last.calls) == (1, 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, wan: Path) -> Iterator[tuple[str, Engine]]:
    models = tmp_path_factory.mktemp("cancel-models")
    shutil.copytree(wan, models / "tiny-wan")
    shutil.copytree(wan, models / "other-wan")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    settings = ServerSettings(model_roots=(models,), output_roots=(tmp_path_factory.mktemp("cancel-out"),),
                              token=TOKEN)
    with engine, LiveServer(create_app(engine, settings)) as url:
        assert httpx.post(f"{url}/v1/images/load", json={"model": "tiny-wan"}, headers=AUTH,
                          timeout=120).status_code == 200
        yield url, engine


@pytest.mark.slow
def test_delete_of_a_running_video_frees_the_engine_for_the_next_job(served: tuple[str, Engine]) -> None:
    """The DELETE arrives while the long clip's first step is inside its first block: no further
    block of that clip runs, and the clip queued behind it renders."""
    url, engine = served
    blocks = engine.images.session.pipeline.transformer.blocks  # type: ignore[union-attr]
    long_id: list[str] = []
    known = threading.Event()
    after_delete: list[int] = []

    def delete_mid_step() -> None:  # on the worker thread, inside the long clip's first step
        assert known.wait(30)
        deleted = httpx.delete(f"{url}/v1/videos/{long_id[0]}", headers=AUTH, timeout=30)
        assert deleted.json()["deleted"] is True
        after_delete.append(second.calls)

    first, second = Watched(blocks[0], then=delete_mid_step), Watched(blocks[1])
    try:
        long = httpx.post(f"{url}/v1/videos", json={"prompt": "a long clip", "frames": 81, "size": "64x64",
                                                    "steps": 50}, headers=AUTH, timeout=30).json()
        long_id.append(long["id"])
        known.set()
        short = httpx.post(f"{url}/v1/videos", json={"prompt": "the next clip", "frames": 5, "size": "64x64",
                                                     "steps": 1}, headers=AUTH, timeout=30).json()
        deadline, state = time.monotonic() + 120, short
        while state["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            state = httpx.get(f"{url}/v1/videos/{short['id']}", headers=AUTH).json()
        assert state["status"] == "completed", state
        # No block of the long clip ran after the DELETE: the second block ran only for the short one.
        assert after_delete == [0] and second.calls == first.calls - 1 > 0
    finally:
        first.remove(), second.remove()
    assert httpx.get(f"{url}/v1/videos/{long_id[0]}", headers=AUTH).status_code == 404


@pytest.mark.slow
def test_the_status_says_loading_while_a_job_loads_its_model(served: tuple[str, Engine],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A clip for a model not loaded: while its job loads that model, GET status names the load
    and the running job (it said idle), then ready once the clip renders."""
    from engine.runtime import engines

    url, _ = served
    entered, gate = threading.Event(), threading.Event()
    start = engines.start_session

    def paused(*args: Any, **kwargs: Any) -> Any:  # the load, held open while the test looks
        entered.set()
        assert gate.wait(60)
        return start(*args, **kwargs)

    monkeypatch.setattr(engines, "start_session", paused)
    clip = httpx.post(f"{url}/v1/videos", json={"prompt": "a fox", "model": "other-wan", "frames": 5,
                                                "size": "64x64", "steps": 1}, headers=AUTH, timeout=30).json()
    try:
        assert entered.wait(60)
        status = httpx.get(f"{url}/v1/images/status", headers=AUTH).json()
        assert (status["load_phase"], status["job"]) == ("loading", "loading")
        assert status["generate"]["state"] == "running" and status["generate"]["id"] == clip["id"]
    finally:
        gate.set()
    deadline, state = time.monotonic() + 120, clip
    while state["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
        state = httpx.get(f"{url}/v1/videos/{clip['id']}", headers=AUTH).json()
    assert state["status"] == "completed"
    assert httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["load_phase"] == "ready"
    httpx.post(f"{url}/v1/images/load", json={"model": "tiny-wan"}, headers=AUTH, timeout=120)


@pytest.mark.slow
def test_ctrl_c_on_serve_during_a_render_exits_130_cleanly(wan: Path, tmp_path: Path) -> None:
    """SIGINT while a clip renders: the job is cancelled inside its step, the worker ends, and the
    process exits 130 within seconds, without a traceback (it aborted in C++ after two)."""
    shutil.copytree(wan, tmp_path / "models" / "tiny-wan")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "DIFFUSION_ENGINE_HOME": str(tmp_path / "home")}
    server = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", str(port), "--models", str(tmp_path / "models"),
         "--load", str(tmp_path / "models" / "tiny-wan"), "--outputs", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                httpx.get(f"{url}/v1/families", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        job = httpx.post(f"{url}/v1/videos", json={"prompt": "a fox", "frames": 81, "size": "64x64",
                                                   "steps": 200}, timeout=30).json()
        while httpx.get(f"{url}/v1/videos/{job['id']}", timeout=10).json()["progress"] == 0:
            assert time.monotonic() < deadline, "the clip never started"
            time.sleep(0.1)
        server.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 20  # the 200-step clip would take a minute more
    assert "Traceback" not in err and "terminate called" not in err and err.rstrip().endswith("interrupted")
