"""The generate queue on a real loopback server: FIFO order, the bound (429 +
Retry-After), cancelling queued and running jobs, job state and results, the
SSE streams of a job and of a training run, and concurrent synchronous clients
that queue instead of refusing each other."""

from __future__ import annotations

from engine.service.tickets import GenerateTicket

import base64
import io
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engine.hardware.probe import probe
from engine.requests import GenerateBody
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from tests.support import LiveServer

TOKEN = "jobs-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUEUE_SIZE = 3
SMALL = {"steps": 1, "width": 64, "height": 64}


class GatedEngine(Engine):
    """The real engine with its generate calls counted (by prompt), and a gate:
    while ``hold`` is set, the next call waits for it before it generates. The server
    passes the checked request (a GenerateTicket), as the CLI does; anything else fails the call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[str] = []
        self.hold: threading.Event | None = None
        self.holding = threading.Event()
        generate = self.images.generate

        def gated(prompt: GenerateTicket, **options: Any) -> list[Any]:
            assert isinstance(prompt, GenerateTicket), f"the server passed {type(prompt).__name__}, not a ticket"
            self.calls.append(prompt.body.prompt)
            gate = self.hold
            if gate is not None:
                self.holding.set()
                gate.wait(timeout=120)
            return generate(prompt, **options)

        self.images.generate = gated  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> Iterator[tuple[str, GatedEngine]]:
    base = tmp_path_factory.mktemp("jobs")
    shutil.copytree(tiny_pipeline("sdxl"), base / "models" / "tiny-sdxl")
    write_dataset(base / "datasets" / "shapes", count=2)
    engine = GatedEngine(registry=load_registry(), hardware=probe(verify=False), runs_dir=base / "runs")
    engine.images.load(str(base / "models" / "tiny-sdxl"))
    settings = ServerSettings(model_roots=(base / "models",), dataset_roots=(base / "datasets",),
                              output_roots=(base / "runs",), token=TOKEN, queue_size=QUEUE_SIZE)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine


def submit(url: str, prompt: str, **options: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/images/jobs", json={"prompt": prompt, **SMALL, **options}, headers=AUTH)
    assert response.status_code == 202, response.text
    return response.json()


def job(url: str, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/images/jobs/{job_id}", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def finished(url: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while (state := job(url, job_id))["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    return state


def hold(engine: GatedEngine) -> threading.Event:
    """Make the next generate wait (running, from the queue's view) until the returned gate is set."""
    gate = threading.Event()
    engine.holding.clear()
    engine.hold = gate
    return gate


def release(engine: GatedEngine, gate: threading.Event) -> None:
    engine.hold = None
    gate.set()


def png_sizes(images: list[str]) -> list[tuple[int, int]]:
    return [Image.open(io.BytesIO(base64.b64decode(image))).size for image in images]


def test_jobs_run_in_order_the_bound_answers_429_and_a_cancelled_queued_job_never_runs(
    served: tuple[str, GatedEngine],
) -> None:
    url, engine = served
    engine.calls.clear()
    gate = hold(engine)
    try:
        first = submit(url, "first")
        assert engine.holding.wait(60)  # the first job runs (held in its generate)
        queued = [submit(url, name) for name in ("second", "third", "fourth")]
        assert [j["state"] for j in queued] == ["queued"] * 3 and [j["position"] for j in queued] == [1, 2, 3]
        # The bound counts waiting jobs: one more is refused, on the job route and on the waiting routes.
        for route, body in (("/v1/images/jobs", {"prompt": "fifth", **SMALL}),
                            ("/v1/images/generate", {"prompt": "fifth", **SMALL}),
                            ("/v1/images/generations", {"prompt": "fifth", "size": "64x64"})):
            full = httpx.post(f"{url}{route}", json=body, headers=AUTH)
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "queue_full" and int(full.headers["Retry-After"]) >= 1
        assert job(url, queued[1]["id"])["position"] == 2
        cancelled = httpx.delete(f"{url}/v1/images/jobs/{queued[1]['id']}", headers=AUTH).json()
        assert cancelled["state"] == "cancelled" and cancelled["started"] is None
        assert job(url, queued[2]["id"])["position"] == 2  # moved up
        listing = httpx.get(f"{url}/v1/images/jobs", headers=AUTH).json()
        assert listing["queue"]["waiting"] == 2 and listing["queue"]["max_waiting"] == QUEUE_SIZE
    finally:
        release(engine, gate)
    results = [finished(url, j["id"]) for j in (first, queued[0], queued[2])]
    assert [r["state"] for r in results] == ["done"] * 3, [r["error"] for r in results]
    assert engine.calls == ["first", "second", "fourth"]  # FIFO; the cancelled job never reached the engine
    assert png_sizes(results[0]["images"]) == [(64, 64)]
    assert results[0]["position"] is None and results[0]["step"] == results[0]["steps"] == 1
    assert job(url, queued[1]["id"])["state"] == "cancelled"
    missing = httpx.get(f"{url}/v1/images/jobs/j-nothing", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_cancelling_the_running_job_frees_the_engine_within_one_step(served: tuple[str, GatedEngine]) -> None:
    url, engine = served
    slow = submit(url, "slow", steps=200)
    following = submit(url, "following")
    deadline = time.monotonic() + 120
    while job(url, slow["id"])["step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    at_cancel = httpx.delete(f"{url}/v1/images/jobs/{slow['id']}", headers=AUTH).json()["step"]
    done = finished(url, following["id"])
    stopped = job(url, slow["id"])
    assert stopped["state"] == "cancelled" and stopped["error"]["code"] == "cancelled"
    assert stopped["step"] <= at_cancel + 1 < stopped["steps"] == 200  # it stopped at the next step
    assert done["state"] == "done" and png_sizes(done["images"]) == [(64, 64)]
    assert engine.status()["job"] is None


def events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of an SSE response, comments skipped."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: ") and name is not None:
            yield name, json.loads(line.removeprefix("data: "))
            name = None


def test_a_job_stream_gives_its_position_its_steps_then_done(served: tuple[str, GatedEngine]) -> None:
    url, engine = served
    gate = hold(engine)
    try:
        ahead = submit(url, "ahead")
        assert engine.holding.wait(60)
        watched = submit(url, "watched", steps=2)
        route = f"{url}/v1/images/jobs/{watched['id']}/events"
        # EventSource sends no headers: the token may come in the query, on the event routes only.
        assert httpx.get(route).status_code == 401
        assert httpx.get(f"{url}/v1/images/jobs/{watched['id']}?token={TOKEN}").status_code == 401
        seen: list[tuple[str, dict[str, Any]]] = []
        with httpx.stream("GET", f"{route}?token={TOKEN}", timeout=120) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            for name, data in events(stream):
                seen.append((name, data))
                if name == "queued":
                    release(engine, gate)
    finally:
        release(engine, gate)
    names = [name for name, _ in seen]
    assert names[0] == "queued" and seen[0][1] == {"id": watched["id"], "position": 1}
    assert "running" in names and names[-1] == "done"  # and then the stream closed
    steps = [data["step"] for name, data in seen if name == "step"]
    assert steps and steps[-1] == 2 and steps == sorted(steps)
    assert png_sizes(seen[-1][1]["images"]) == [(64, 64)]
    assert finished(url, ahead["id"])["state"] == "done"


def test_concurrent_waiting_clients_queue_instead_of_refusing_each_other(served: tuple[str, GatedEngine]) -> None:
    url, _ = served
    answers: list[httpx.Response] = []

    def ask(route: str, body: dict[str, Any]) -> None:
        answers.append(httpx.post(f"{url}{route}", json=body, headers=AUTH, timeout=120))

    # (The OpenAI route queues too: a full queue refuses it with 429, see the first test.)
    asks = [("/v1/images/generate", {"prompt": f"client {k}", **SMALL}) for k in range(3)]
    threads = [threading.Thread(target=ask, args=a) for a in asks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(a.status_code for a in answers) == [200, 200, 200], [a.text[:200] for a in answers]
    assert all(a.headers["X-Job-Id"].startswith("j-") for a in answers)
    status = httpx.get(f"{url}/v1/images/status", headers=AUTH).json()
    assert status["generate"]["state"] == "done" and status["queue"]["waiting"] == 0


@pytest.mark.slow
def test_the_training_stream_shows_the_run_s_steps(served: tuple[str, GatedEngine]) -> None:
    url, engine = served
    body = {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "resolution": 64, "steps": 1, "lora_rank": 2,
            "device": "cpu"}
    seen: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("GET", f"{url}/v1/training/events", headers=AUTH, timeout=300) as stream:
        started = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH, timeout=120)
        assert started.status_code == 200, started.text
        for name, data in events(stream):
            seen.append((name, data))
            if name == "state" and data["status"] in ("completed", "failed", "stopped", "cancelled"):
                break
    assert seen[0][0] == "state"  # the state at once (idle, or the new run)
    steps = [data for name, data in seen if name == "step"]
    assert steps and steps[-1]["step"] == 1 and steps[-1]["run_id"] == started.json()["run_id"]
    assert isinstance(steps[-1]["loss"], float) and isinstance(steps[-1]["lr"], float)
    assert seen[-1][1]["status"] == "completed"
    engine.training.wait(timeout=120)


def test_a_job_faster_than_its_stream_still_shows_it_ran_to_its_last_step() -> None:
    """The stream reads the job when it is signalled: a tiny job can finish before the stream
    sees a step (a busy machine made the stream test fail so). Its stream still gives
    ``running`` and the last ``step`` before ``done``, whatever the machine's load."""
    import asyncio

    from engine.requests import GenerateBody
    from engine.server.events import job_events
    from engine.server.job import Job

    from types import SimpleNamespace

    model = SimpleNamespace(name="tiny-sdxl", key="/models/tiny-sdxl")  # the record to_dict reads, no model needed
    done = Job("j-1-fast", GenerateBody(prompt="a fox"), None, model, state="done", step=2, steps=2)

    async def collect() -> list[str]:
        return [chunk async for chunk in job_events(done)]

    names = [chunk.split("\n")[0].removeprefix("event: ") for chunk in asyncio.run(collect())]
    assert names == ["running", "step", "done"]
