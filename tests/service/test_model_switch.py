"""Models that load themselves, on a real loopback server: a request naming a model loads it
(judged against that model before anything is evicted), jobs queued behind a switch run on
their own model (grouped where that saves a load, no job overtaken for ever), and the doomed
requests naming a model evict nothing: the 0-eviction matrix's ``model`` rows."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.contract.plugins import load_registry
from engine.hardware.probe import probe
from engine.requests import GenerateBody
from engine.server.app import ServerSettings, create_app
from engine.server.jobs import MAX_OVERTAKEN
from engine.service.facade import Engine
from tests.support import HostModel, LiveServer
from tests.support import truncated_pipeline

TOKEN = "switch-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SMALL = {"steps": 1, "width": 64, "height": 64}


class WatchedEngine(Engine):
    """The real engine, recording each generate's prompt with the model loaded when it ran and
    each load's model; while ``hold`` is set, the next generate waits for it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ran: list[tuple[str, str]] = []
        self.loads: list[str] = []
        self.hold: threading.Event | None = None
        self.holding = threading.Event()
        run, load = self.loaded.run, self.loaded.load

        def watched(ticket: Any, *args: Any, **options: Any) -> list[Any]:
            gate = self.hold
            if gate is not None:
                self.holding.set()
                gate.wait(timeout=120)
            try:
                return run(ticket, *args, **options)
            finally:  # the model it ran on: its own, loaded at its turn when another was in
                session = self.loaded.session
                self.ran.append((ticket.body.prompt, Path(session.source.location).name if session else "-"))

        def counted(ticket: Any) -> dict[str, object]:
            status = load(ticket)
            self.loads.append(Path(str(self.loaded.session.source.location)).name)  # type: ignore[union-attr]
            return status

        self.loaded.run = watched  # type: ignore[method-assign]
        self.loaded.load = counted  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           tiny_pipeline: Callable[[str], Path]) -> Iterator[tuple[str, WatchedEngine, HostModel, Path]]:
    base = tmp_path_factory.mktemp("switch")
    models = base / "models"
    shutil.copytree(tiny_pipeline("sdxl"), models / "tiny-sdxl")
    shutil.copytree(tiny_pipeline("zimage"), models / "tiny-zimage")
    shutil.copytree(tiny_pipeline("wan"), models / "tiny-wan")
    truncated_pipeline(tiny_pipeline("zimage"), models / "cut-zimage", "transformer")
    (models / "not-a-pipeline").mkdir()
    (models / "not-a-pipeline" / "notes.txt").write_text("no model_index.json here")
    _hidream_without_its_llama(tiny_pipeline("hidream"), models / "hidream-no-llama")
    _ideogram_fp8_cut(models / "ideogram-fp8-cut")
    _stored_nf4(models / "tiny-zimage", models / "zimage-nf4")
    _foreign_lora(base / "loras" / "foreign.safetensors")
    engine = WatchedEngine(registry=load_registry(), hardware=probe(verify=False), runs_dir=base / "runs")
    host = HostModel(engine)
    engine.images.load(str(models / "tiny-sdxl"))
    settings = ServerSettings(model_roots=(models,), output_roots=(base / "runs",), lora_roots=(base / "loras",),
                              token=TOKEN, queue_size=12)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, host, models


def _hidream_without_its_llama(full: Path, target: Path) -> None:
    """As HiDream publishes it: the Llama encoder named, not shipped (the suite's hub is offline
    and its cache holds no copy of the repo the engine would take it from)."""
    from families.hidream.tiny import write_repo_layout

    write_repo_layout(full, target)


def _ideogram_fp8_cut(target: Path) -> None:
    """Ideogram's fp8 layout with a block's output projection gone: its conversion cannot cover it."""
    from safetensors.torch import load_file, save_file

    from families.ideogram4.tiny import build_tiny_pipeline, write_fp8_fused_layout

    dense = build_tiny_pipeline(target.parent.parent / "ideogram-dense")
    write_fp8_fused_layout(dense, target)
    file = next((target / "transformer").glob("*.safetensors"))
    save_file({k: v for k, v in load_file(str(file)).items() if not k.startswith("layers.1.attention.o.")}, str(file))


def _stored_nf4(dense: Path, target: Path) -> None:
    """A copy whose denoiser config says bitsandbytes stored it nf4: no NVIDIA GPU computes it here."""
    shutil.copytree(dense, target)
    config = json.loads((target / "transformer" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (target / "transformer" / "config.json").write_text(json.dumps(config))


def _foreign_lora(target: Path) -> None:
    """A LoRA of which no module is Z-Image's: even a partial load has nothing to apply."""
    import torch
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True)
    save_file({"transformer.nope.proj.lora_A.weight": torch.zeros(4, 64),
               "transformer.nope.proj.lora_B.weight": torch.zeros(64, 4)}, str(target))


def _submit(url: str, prompt: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/images/jobs", json={"prompt": prompt, **SMALL, **fields}, headers=AUTH)
    assert response.status_code == 202, response.text
    return response.json()


def _wait(url: str, job_id: str) -> dict[str, Any]:
    with httpx.Client(headers=AUTH, timeout=120) as client:
        for _ in range(1200):
            job = client.get(f"{url}/v1/images/jobs/{job_id}").json()
            if job["state"] in ("done", "failed", "cancelled"):
                return job
            threading.Event().wait(0.1)
    raise AssertionError(f"job {job_id} did not finish")


def _loaded(url: str) -> str:
    status = httpx.get(f"{url}/v1/images/status", headers=AUTH).json()
    return Path(status["pipeline"]["model"]["location"]).name


@pytest.mark.slow
def test_queued_jobs_run_on_their_own_model_grouped_and_never_overtaken_for_ever(
        served: tuple[str, WatchedEngine, HostModel, Path]) -> None:
    """With tiny-sdxl loaded and its job held: a job naming tiny-zimage, then five for the
    loaded model (no model named), then another for tiny-zimage. The loaded model's jobs go
    first until the switch has been passed MAX_OVERTAKEN times; the switch loads tiny-zimage
    once and the job behind it on the same model goes with it; the last sdxl job, queued
    when sdxl was loaded, loads sdxl again rather than failing or drawing with zimage."""
    url, engine, _, _ = served
    assert _loaded(url) == "tiny-sdxl"
    engine.ran.clear(), engine.loads.clear()
    engine.hold, engine.holding = threading.Event(), threading.Event()
    first = _submit(url, "held")
    assert engine.holding.wait(60)
    switch = _submit(url, "zimage-1", model="tiny-zimage")
    stay = [_submit(url, f"sdxl-{n}") for n in range(1, 6)]
    after = _submit(url, "zimage-2", model="tiny-zimage")
    assert switch["model"] == "tiny-zimage" and stay[0]["model"] == "tiny-sdxl" and first["model"] == "tiny-sdxl"
    engine.hold.set()
    engine.hold = None
    jobs = [_wait(url, job["id"]) for job in (first, switch, *stay, after)]
    assert all(job["state"] == "done" for job in jobs), [job["error"] for job in jobs]
    overtaking = [f"sdxl-{n}" for n in range(1, MAX_OVERTAKEN + 1)]
    order = ["held", *overtaking, "zimage-1", "zimage-2", *[f"sdxl-{n}" for n in range(MAX_OVERTAKEN + 1, 6)]]
    assert [prompt for prompt, _ in engine.ran] == order
    assert all(model == ("tiny-zimage" if prompt.startswith("zimage") else "tiny-sdxl")
               for prompt, model in engine.ran), engine.ran
    assert engine.loads == ["tiny-zimage", "tiny-sdxl"]  # one switch there, one back for the job queued on sdxl
    assert all(job["model"] == ("tiny-zimage" if job["request"]["prompt"].startswith("zimage") else "tiny-sdxl")
               for job in jobs)


@pytest.mark.slow
def test_every_door_takes_a_model_name_and_openai_names_mean_the_loaded_model(
        served: tuple[str, WatchedEngine, HostModel, Path]) -> None:
    """The native generate, OpenAI's generations (its client's ``model``) and Python's typed
    request each load the model they name; ``dall-e-3`` and the loaded model's own names run
    on what is loaded, loading nothing."""
    from openai import OpenAI

    url, engine, _, models = served
    engine.loads.clear()
    client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    listed = {model.id: model.model_extra for model in client.models.list()}
    assert {"tiny-sdxl", "tiny-zimage", "tiny-wan"} <= set(listed) and "notes.txt" not in listed
    assert listed["tiny-sdxl"]["loaded"] and not listed["tiny-zimage"]["loaded"]
    assert (listed["tiny-zimage"]["family"], listed["tiny-wan"]["family"]) == ("zimage", "wan")
    client.images.generate(model="tiny-zimage", prompt="a fox", size="64x64", extra_body={})
    assert _loaded(url) == "tiny-zimage"
    client.images.generate(model="dall-e-3", prompt="a fox", size="64x64")
    client.images.generate(model="zimage", prompt="a fox", size="64x64")  # the family's name
    assert engine.loads == ["tiny-zimage"]
    native = httpx.post(f"{url}/v1/images/generate", json={"prompt": "a fox", "model": "tiny-sdxl", **SMALL},
                        headers=AUTH, timeout=120)
    assert native.status_code == 200 and _loaded(url) == "tiny-sdxl"
    [image] = engine.images.generate(GenerateBody(prompt="a fox", model=str(models / "tiny-zimage"), **SMALL))
    assert image.size == (64, 64) and _loaded(url) == "tiny-zimage"
    assert engine.loads == ["tiny-zimage", "tiny-sdxl", "tiny-zimage"]


#: (route, request, HTTP status, code): requests naming a model that cannot serve them.
DOOMED = [
    ("jobs", {"model": "no-such-model"}, 404, "model_not_found"),
    ("jobs", {"model": "/etc"}, 400, "path_outside_roots"),
    ("jobs", {"model": "../../outside"}, 400, "path_outside_roots"),
    ("jobs", {"model": "not-a-pipeline"}, 400, "not_a_pipeline"),
    ("jobs", {"model": "cut-zimage"}, 400, "corrupt_checkpoint"),
    ("jobs", {"model": "tiny-wan"}, 400, "wrong_output"),  # a video model through the images door
    ("jobs", {"model": "flux.1-dev"}, 400, "hub_not_allowed"),
    ("jobs", {"model": "tiny-zimage", "frames": 9}, 400, "wrong_output"),
    ("jobs", {"model": "tiny-zimage", "window_frames": 9}, 400, "wrong_output"),  # windows of an image model
    ("jobs", {"model": "hidream-no-llama"}, 400, "component_missing"),  # its Llama's repo: not cached, hub offline
    ("jobs", {"model": "ideogram-fp8-cut"}, 400, "corrupt_checkpoint"),  # the fp8 layout converted on meta first
    ("jobs", {"model": "zimage-nf4"}, 400, "stored_scheme_unsupported"),  # bitsandbytes' nf4 with no NVIDIA GPU
    ("jobs", {"model": "tiny-zimage", "loras": [{"path": "foreign.safetensors", "partial": True}]}, 400,
     "lora_mismatch"),  # partial, and nothing in it matches
    ("generations", {"model": "tiny-wan"}, 400, "wrong_output"),
    ("generations", {"model": "no-such-model"}, 404, "model_not_found"),
    ("videos", {"model": "tiny-zimage"}, 400, "wrong_output"),  # an image model through the videos door
    ("videos", {"model": "tiny-wan", "frames": "8"}, 422, "invalid_video_shape"),
    ("videos", {"model": "tiny-wan", "window_frames": "6"}, 422, "invalid_video_shape"),  # a window off the lattice
    ("videos", {"model": "cut-zimage"}, 400, "corrupt_checkpoint"),
]


@pytest.mark.parametrize(("route", "fields", "status", "code"), DOOMED,
                         ids=[f"{r}-{next(iter(f.values()))}-{c}" for r, f, _, c in DOOMED])
def test_a_doomed_request_naming_a_model_evicts_nothing(
        served: tuple[str, WatchedEngine, HostModel, Path], route: str, fields: dict[str, Any], status: int,
        code: str) -> None:
    """The 0-eviction matrix's ``model`` rows: refused with its code before anything is queued,
    the host's model and the loaded pipeline left where they were."""
    url, engine, host, _ = served
    loaded, evicted, loads = _loaded(url), host.evicted, list(engine.loads)
    jobs = len(httpx.get(f"{url}/v1/images/jobs", headers=AUTH).json()["jobs"])
    if route == "jobs":
        response = httpx.post(f"{url}/v1/images/jobs", json={"prompt": "a fox", **SMALL, **fields}, headers=AUTH)
    elif route == "generations":
        response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "size": "64x64", **fields},
                              headers=AUTH)
    else:
        response = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", **fields}, headers=AUTH)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    assert host.evicted == evicted and engine.loads == loads and _loaded(url) == loaded
    assert len(httpx.get(f"{url}/v1/images/jobs", headers=AUTH).json()["jobs"]) == jobs


def test_a_replica_never_switches_models(tiny_pipeline: Callable[[str], Path]) -> None:
    """A replicated service's replicas serve their --load model: naming another is refused
    (``not_with_replicas``) before anything is queued; the loaded model's own name still runs."""
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    engine.images.load(str(tiny_pipeline("sdxl")))
    settings = ServerSettings(model_roots=(tiny_pipeline("zimage").parent, tiny_pipeline("sdxl").parent), replica="r1")
    with LiveServer(create_app(engine, settings)) as url:
        other = httpx.post(f"{url}/v1/images/jobs", json={"prompt": "x", "model": "zimage", **SMALL})
        assert other.status_code == 409 and other.json()["error"]["code"] == "not_with_replicas"
        own = httpx.post(f"{url}/v1/images/generate", json={"prompt": "x", "model": "sdxl", **SMALL}, timeout=120)
        assert own.status_code == 200 and engine.loaded.target().family.name == "sdxl"  # type: ignore[union-attr]
    engine.images.unload()
