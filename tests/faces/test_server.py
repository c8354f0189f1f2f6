"""The HTTP API on a real loopback server: OpenAI client, confinement, token, body cap,
one error shape, strict bodies, cancelled generates, a killed trainer."""

from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from tests.support import HostModel, LiveServer

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 256 * 1024


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
    Engine().catalog.tiny_pipeline("sdxl", roots.models / "tiny-sdxl")  # as `tiny save` writes it: 64 px its own
    write_dataset(roots.datasets / "shapes", count=2)
    # Real data outside the roots, and a symlink inside that leads to it.
    shutil.copytree(tiny_pipeline("sdxl"), roots.outside / "sdxl")
    write_dataset(roots.outside / "data", count=2)
    (roots.datasets / "escape").symlink_to(roots.outside / "data")
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=roots.outputs)
    host = HostModel(engine, name="host.llm", size_gb=0.0)
    settings = ServerSettings(
        model_roots=(roots.models,), dataset_roots=(roots.datasets,), output_roots=(roots.outputs,), token=TOKEN,
        max_body_bytes=MAX_BODY,
    )
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, roots, host


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
        ("resume_from", "../outside/runs/checkpoints/step-1"),
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
    assert host.evicted == before and engine.training.status() is None
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
    # OpenAI's other answers: a URL this server serves (with the token, as every route) and
    # size "auto", the loaded model's own default size.
    hosted = client.images.generate(model="tiny-sdxl", prompt="a red fox", size="auto", response_format="url")
    [item] = hosted.data
    assert item.url and item.url.startswith(f"{url}/v1/gallery/") and item.b64_json is None
    assert httpx.get(item.url).status_code == 401
    fetched = httpx.get(item.url, headers=AUTH)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    # "auto" is the tiny model's own 64 px (its diffusion_engine.json), not the family's 1024.
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)
    unsized = httpx.post(f"{url}/v1/images/generate", json={"prompt": "x", "steps": 2}, headers=AUTH, timeout=120)
    [default] = unsized.json()["images"]
    assert Image.open(io.BytesIO(base64.b64decode(default))).size == (64, 64)
    assert httpx.get(f"{url}/v1/images/files/..%2Frun.json", headers=AUTH).status_code == 404
    generated = httpx.post(f"{url}/v1/images/generate", json={"prompt": "x", "steps": 2, "width": 64, "height": 64}, headers=AUTH, timeout=120)
    assert generated.status_code == 200 and len(generated.json()["images"]) == 1
    assert httpx.post(f"{url}/v1/images/unload", headers=AUTH).json() == {"unloaded": True}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("resume", "status", "code"),
    [("no-such-run", 404, "run_not_found"), ("../outside", 422, "invalid_request")],
)
def test_a_resume_names_a_run_of_the_servers_runs_folder(
    served: tuple[str, Engine, Roots, HostModel], resume: str, status: int, code: str
) -> None:
    """``resume`` reaches Engine.start_training as a run id; a path is not a run id."""
    url, engine, _, host = served
    body = {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "resolution": 64, "steps": 2, "device": "cpu",
            "resume": resume}
    before = host.evicted
    response = httpx.post(f"{url}/v1/training/start", json=body, headers=AUTH)
    assert response.status_code == status and response.json()["error"]["code"] == code, response.text
    assert host.evicted == before and engine.training.status() is None


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
    os.kill(engine.training.current.pid, signal.SIGKILL)  # noqa: SLF001 - the OOM killer's part
    while (status := httpx.get(f"{url}/v1/training/status", headers=AUTH).json())["status"] != "failed":
        assert time.monotonic() < deadline + 60
        time.sleep(0.1)
    assert status["error"]["code"] == "trainer_died" and "signal 9" in status["error"]["message"]
    while httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["gpu_owner"] is not None:
        assert time.monotonic() < deadline + 60
        time.sleep(0.05)
    runs = httpx.get(f"{url}/v1/training/runs", headers=AUTH).json()
    assert runs[0]["status"] == "failed"
    again = httpx.post(f"{url}/v1/training/start", json={**body, "steps": 2}, headers=AUTH, timeout=60)
    assert again.status_code == 200, again.text
    assert engine.training.wait(timeout=300).status == "completed"


def test_serve_command_binds_loopback_and_requires_its_token(tmp_path: Path) -> None:
    """``diffusion-engine serve`` as a user types it, in its own process: every socket
    that process listens on is bound to 127.0.0.1 (read from the process's own sockets,
    not from a URL the test or the log made), this machine's other addresses are
    refused, and the token it was given is required."""
    import socket
    import subprocess
    import sys

    import psutil

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", str(port), "--token", "cli-token",
         "--models", str(tmp_path), "--outputs", str(tmp_path / "runs")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        listening: list[Any] = []
        while not listening:
            assert process.poll() is None, "serve exited before it listened"
            assert time.monotonic() < deadline, "serve did not listen within 90 s"
            listening = [c for c in psutil.Process(process.pid).net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN]
            time.sleep(0.2)
        assert {(c.laddr.ip, c.laddr.port) for c in listening} == {("127.0.0.1", port)}
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for address in others:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{address}:{port}/v1/families", timeout=5)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/families", timeout=10).status_code == 401
        families = httpx.get(f"{url}/v1/families", headers={"Authorization": "Bearer cli-token"}, timeout=10)
        assert {f["name"] for f in families.json()} >= {"flux", "sdxl"}
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- hardening: start-up refusals, auth before the body, one error shape --------------------


def test_an_empty_token_or_a_public_bind_without_one_refuses_to_start(tmp_path: Path) -> None:
    from engine.server.settings import InsecureServer, is_loopback
    from tests.support import run_cli

    # 192.0.2.1 (TEST-NET) is never this machine's: were the refusal missing, the bind would fail, not open.
    runs = ["--outputs", str(tmp_path / "runs"), "--port", "0"]
    empty = run_cli("serve", "--token", "", *runs)
    empty_env = run_cli("serve", *runs, env={"DIFFUSION_ENGINE_TOKEN": ""})
    public = run_cli("serve", "--host", "192.0.2.1", *runs)
    assert empty.returncode == 2 and "error[empty_token]" in empty.stderr and "--token" in empty.stderr
    assert empty_env.returncode == 2 and "error[empty_token]" in empty_env.stderr
    assert public.returncode == 2 and "error[token_required]" in public.stderr
    assert "--insecure-no-token" in public.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was set up
    with pytest.raises(InsecureServer):
        ServerSettings(token="   ")
    ServerSettings(insecure_no_token=True).check_bind("0.0.0.0")  # the explicit opt-out
    ServerSettings(token="t").check_bind("0.0.0.0")
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        ServerSettings().check_bind(host)
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_serve_flags_reach_the_app_insecure_opt_out_and_body_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app ``serve`` builds for a public host with ``--insecure-no-token``,
    served here on loopback instead (the uvicorn server only hands it over)."""
    import uvicorn

    from engine.cli import main

    handed: dict[str, Any] = {}
    monkeypatch.delenv("DIFFUSION_ENGINE_TOKEN", raising=False)
    with monkeypatch.context() as serving:
        serving.setattr(uvicorn.Server, "run",
                        lambda server, *_: handed.update(app=server.config.app, host=server.config.host))
        code = main(["serve", "--host", "192.0.2.1", "--insecure-no-token", "--max-body-mb", "0.001",
                     "--outputs", str(tmp_path / "runs")])
    assert code == 0 and handed["host"] == "192.0.2.1"
    with LiveServer(handed["app"]) as url:
        assert httpx.get(f"{url}/v1/families").status_code == 200  # no token: the operator opted out
        big = httpx.post(f"{url}/v1/images/plan", json={"family": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"


def _raw(url: str, head: str, chunks: Sequence[bytes] = ()) -> tuple[int, dict[str, Any]]:
    """One request on a raw socket: ``head`` (request line and headers), then
    ``chunks`` as they are (never more than the test says), then the response."""
    import json
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for chunk in chunks:
            sock.sendall(chunk)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or _closed(data)
        header, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536) or _closed(data)
    return int(header.split()[1]), json.loads(body)


def _closed(data: bytes) -> bytes:
    raise AssertionError(f"the server closed the connection before a full response: {data[:200]!r}")


def test_the_token_is_checked_before_the_body_is_read(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, *_ = served
    # A 200 MB body is declared and never sent: the 401 can only come before the body was read.
    status, body = _raw(url, "POST /v1/images/generate HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
                        "Content-Length: 200000000\n")
    assert status == 401 and body["error"]["code"] == "unauthorized"
    chunked = _raw(url, "POST /v1/training/start HTTP/1.1\nHost: 127.0.0.1\nTransfer-Encoding: chunked\n", [b"10\r\n"])
    assert chunked[0] == 401
    # The schema stays readable without the token; every other path needs it, even an unknown one.
    assert httpx.get(f"{url}/openapi.json").status_code == 200
    assert httpx.get(f"{url}/v1/nowhere").status_code == 401


def test_bodies_over_the_cap_are_refused_declared_or_streamed(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, *_ = served
    head = f"POST /v1/images/plan HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {TOKEN}\nContent-Type: application/json\n"
    status, body = _raw(url, head + f"Content-Length: {MAX_BODY + 1}\n")
    assert status == 413 and body["error"]["code"] == "body_too_large" and str(MAX_BODY) in body["error"]["message"]
    # Chunked: no length is declared; the bytes are counted as they arrive (the body is never finished).
    chunk = b"x" * 65536
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_BODY // len(chunk) + 1)
    status, body = _raw(url, head + "Transfer-Encoding: chunked\n", chunks)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    # Under the cap, the same route answers.
    assert httpx.post(f"{url}/v1/images/plan", json={"family": "sdxl"}, headers=AUTH).status_code == 200


def _assert_error_shape(response: httpx.Response, status: int, code: str) -> dict[str, str]:
    assert response.status_code == status, response.text[:500]
    payload = response.json()
    assert list(payload) == ["error"] and set(payload["error"]) == {"code", "message"}, payload
    assert payload["error"]["code"] == code and payload["error"]["message"]
    return payload["error"]


def test_every_status_has_the_one_error_shape(served: tuple[str, Engine, Roots, HostModel]) -> None:
    url, *_ = served
    _assert_error_shape(httpx.get(f"{url}/v1/nowhere", headers=AUTH), 404, "not_found")
    _assert_error_shape(httpx.delete(f"{url}/v1/families", headers=AUTH), 405, "method_not_allowed")
    _assert_error_shape(httpx.post(f"{url}/v1/images/plan", content=b"{not json", headers=AUTH), 422, "invalid_request")
    _assert_error_shape(httpx.post(f"{url}/v1/images/plan", json=[1], headers=AUTH), 422, "invalid_request")
    _assert_error_shape(httpx.get(f"{url}/v1/families"), 401, "unauthorized")
    _assert_error_shape(httpx.post(f"{url}/v1/images/generate", json={"prompt": "x"}, headers=AUTH), 409, "not_loaded")


def test_an_unexpected_failure_is_a_500_in_the_shape_logged_not_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=tmp_path)
    app = create_app(engine, ServerSettings(token=TOKEN))

    @app.get("/v1/broken")
    def broken() -> None:  # a bug nothing foresaw, deep in a route
        raise ZeroDivisionError("internal detail 0xdeadbeef")

    with LiveServer(app) as url, caplog.at_level("ERROR", logger="engine.server"):
        error = _assert_error_shape(httpx.get(f"{url}/v1/broken", headers=AUTH), 500, "internal_error")
        assert httpx.get(f"{url}/v1/families", headers=AUTH).status_code == 200  # the server lives on
    assert "0xdeadbeef" not in error["message"] and "Traceback" not in error["message"]
    assert any("0xdeadbeef" in record.getMessage() + str(record.exc_info) for record in caplog.records)


def test_messages_echo_at_most_200_characters_of_any_input(served: tuple[str, Engine, Roots, HostModel]) -> None:
    import re

    url, *_ = served
    huge = "q" * 200_000
    for route, body in [
        ("/v1/images/plan", {"family": huge}),
        ("/v1/images/plan", {"model": huge}),
        ("/v1/images/plan", {"model": "a/" + "b" * 3000}),
        ("/v1/images/plan", {huge: 1}),
        ("/v1/training/start", {"base_model": "tiny-sdxl", "dataset_dir": "d/" * 1500}),
        ("/v1/images/generate", {"prompt": "x", "width": huge}),
    ]:
        response = httpx.post(f"{url}{route}", json=body, headers=AUTH)
        assert 400 <= response.status_code < 500, response.text[:300]
        message = response.json()["error"]["message"]
        assert len(message) <= 1100 and not re.search(r"[qb]{201}", message), (route, message[:300])
    named = httpx.post(f"{url}/v1/images/plan", json={"family": "z" * 150}, headers=AUTH)
    assert named.status_code == 404 and "z" * 150 in named.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/images/plan", {"family": "sdxl", "steps": True}),
        ("/v1/images/plan", {"family": "sdxl", "threads": "4"}),
        ("/v1/images/generate", {"prompt": "x", "steps": True}),
        ("/v1/images/generate", {"prompt": "x", "count": 2.0}),
        ("/v1/images/generate", {"prompt": "x", "guidance": "7"}),
        ("/v1/images/generations", {"prompt": "x", "n": True}),
        ("/v1/training/start", {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "steps": True}),
        ("/v1/training/start", {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "steps": "2"}),
        ("/v1/training/stop", {"save": 1}),
    ],
)
def test_json_types_are_strict(served: tuple[str, Engine, Roots, HostModel], route: str, body: dict[str, object]) -> None:
    url, engine, _, host = served
    before = host.evicted
    run_before = (engine.training.status() or {}).get("run_id")  # an earlier test's run, if any
    _assert_error_shape(httpx.post(f"{url}{route}", json=body, headers=AUTH), 422, "invalid_request")
    assert host.evicted == before and (engine.training.status() or {}).get("run_id") == run_before


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/images/generations", {"prompt": "x", "size": "9984x9984"}),
        ("/v1/images/generations", {"prompt": "x", "size": "16x16"}),
        ("/v1/images/generations", {"prompt": "x", "size": "1000x1000"}),
        ("/v1/images/generations", {"prompt": "x", "n": 9}),
        ("/v1/images/generate", {"prompt": "x", "width": 9984, "height": 64}),
        ("/v1/images/generate", {"prompt": "x", "width": 16, "height": 16, "guidance": 0}),
        ("/v1/images/generate", {"prompt": "x", "steps": 201}),
        ("/v1/images/generate", {"prompt": "x", "count": 9}),
    ],
)
def test_every_generate_route_has_the_same_caps(served: tuple[str, Engine, Roots, HostModel], route: str, body: dict[str, object]) -> None:
    url, *_ = served
    _assert_error_shape(httpx.post(f"{url}{route}", json=body, headers=AUTH), 422, "invalid_request")


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/images/plan", {"model": "m" * 256}),  # one part over NAME_MAX: ENAMETOOLONG
        ("/v1/images/load", {"model": "org/" + "m" * 300}),
        ("/v1/training/start", {"base_model": "tiny-sdxl", "dataset_dir": "d" * 300}),
        ("/v1/training/start", {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "output_dir": "o" * 300}),
        ("/v1/images/plan", {"model": "~no-such-user-here/model"}),
        ("/v1/images/plan", {"model": "a\x00b"}),
    ],
)
def test_paths_no_file_system_can_take_are_invalid_requests(
    served: tuple[str, Engine, Roots, HostModel], route: str, body: dict[str, object]
) -> None:
    url, engine, _, host = served
    before = host.evicted
    run_before = (engine.training.status() or {}).get("run_id")  # an earlier test's run, if any
    _assert_error_shape(httpx.post(f"{url}{route}", json=body, headers=AUTH), 422, "invalid_path")
    assert host.evicted == before and (engine.training.status() or {}).get("run_id") == run_before


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("/v1/images/plan", '{"family": "\\ud800"}'),
        ("/v1/images/plan", '{"model": "tiny-\\udfff"}'),
        ("/v1/images/generate", '{"prompt": "a \\ud83d fox"}'),
        ("/v1/images/plan", '{"\\ud800": 1}'),
        ("/v1/training/start", '{"base_model": "tiny-sdxl", "dataset_dir": "shapes", "lora_targets": ["\\ud800"]}'),
        ("/v1/images/generations", '{"prompt": "x", "user": "\\ud800"}'),
    ],
)
def test_lone_surrogates_are_invalid_requests(served: tuple[str, Engine, Roots, HostModel], route: str, raw: str) -> None:
    url, *_ = served
    response = httpx.post(f"{url}{route}", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    error = _assert_error_shape(response, 422, "invalid_request")
    assert "surrogate" in error["message"]


@pytest.mark.slow
def test_a_generate_whose_client_went_away_is_cancelled(served: tuple[str, Engine, Roots, HostModel]) -> None:
    import json
    import socket

    url, engine, _, _ = served
    assert httpx.post(f"{url}/v1/images/load", json={"model": "tiny-sdxl"}, headers=AUTH, timeout=120).status_code == 200
    try:
        body = json.dumps({"prompt": "a slow fox", "steps": 200, "width": 64, "height": 64}).encode()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(f"POST /v1/images/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["generate"]["step"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sock.close()  # the client goes away mid-generate
        while (progress := httpx.get(f"{url}/v1/images/status", headers=AUTH).json()["generate"])["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert progress["state"] == "cancelled" and progress["step"] < progress["steps"] == 200
        # The engine is free again, and the smallest size every route allows renders, without guidance too.
        small = httpx.post(f"{url}/v1/images/generate", json={"prompt": "x", "steps": 2, "width": 64, "height": 64,
                                                              "guidance": 0}, headers=AUTH, timeout=120)
        assert small.status_code == 200 and len(small.json()["images"]) == 1
    finally:
        assert httpx.post(f"{url}/v1/images/unload", headers=AUTH).json() == {"unloaded": True}
