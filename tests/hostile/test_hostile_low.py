"""The last low holes hostile input found: every malformed video body is a 422 naming its
field (never a 500), a keep-alive is bounded where it is parsed, the server's token never
reaches a child process, and a Host header with a control character is refused. A real
server on loopback (no model needs to be loaded: each is refused at the door)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    with LiveServer(create_app(engine, ServerSettings())) as served:
        yield served


@pytest.mark.parametrize(("content", "headers", "field"), [
    (b'{"prompt": "a fox", "size": "00x00"}', {"Content-Type": "application/json"}, "size"),
    (b'{"prompt": "a fox", "size": "0x10"}', {"Content-Type": "application/json"}, "size"),
    (b'{"prompt": "a fox", "size": ', {"Content-Type": "application/json"}, "body"),
    (b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}, "body"),
    (b'{"prompt": "a fox", "seconds": "many"}', {"Content-Type": "application/json"}, "seconds"),
], ids=["size-00x00", "size-zero-side", "malformed-json", "100000-deep", "seconds-not-a-number"])
def test_a_malformed_video_body_is_a_422_naming_its_field(url: str, content: bytes, headers: dict[str, str],
                                                          field: str) -> None:
    answer = httpx.post(f"{url}/v1/videos", content=content, headers=headers, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_request" and field in answer.text, answer.text


def test_the_multipart_size_00x00_is_a_422_too(url: str) -> None:
    answer = httpx.post(f"{url}/v1/videos", data={"prompt": "a fox", "size": "00x00"},
                        files={"note": ("note.txt", b"multipart")}, timeout=30)
    assert answer.status_code == 422 and "size" in answer.text, answer.text


@pytest.mark.parametrize("seconds", [1e308, 7 * 24 * 3600 + 1, -1.0])
def test_a_keep_alive_past_a_week_is_refused_where_it_is_parsed(seconds: float,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EngineError) as refused:
        ServerSettings(keep_alive_s=seconds)
    assert refused.value.code == "invalid_config" and "--keep-alive" in refused.value.message
    from engine.cli import main

    assert main(["serve", "--keep-alive", repr(seconds), "--port", "0"]) == 2
    assert "error[invalid_config]: --keep-alive" in capsys.readouterr().err


def test_a_week_of_keep_alive_is_taken() -> None:
    assert ServerSettings(keep_alive_s=7 * 24 * 3600).keep_alive_s == 7 * 24 * 3600


@pytest.mark.parametrize("host", ["localhost\t:{port}", "local\thost:{port}", "localhost:{port}\tevil.example"])
def test_a_host_header_with_a_control_character_is_refused(url: str, host: str) -> None:
    """Sent raw (HTTP clients refuse to send such a header): the guard answers 400, never
    reading the name as one of its own."""
    import socket

    address, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((address, int(port)), timeout=30) as connection:
        connection.sendall(f"GET /v1/families HTTP/1.1\r\nHost: {host.format(port=port)}\r\n"
                           "Connection: close\r\n\r\n".encode("latin-1"))
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and b'"bad_request"' in reply, reply[:400]


def test_the_servers_token_never_reaches_a_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers and the fork server get child_env(); the stable-diffusion.cpp worker gets
    child_environment(): neither carries DIFFUSION_ENGINE_TOKEN. A real child checks."""
    import os
    import subprocess
    import sys

    from engine.places import child_environment
    from engine.training.lineage import child_env

    monkeypatch.setenv("DIFFUSION_ENGINE_TOKEN", "the-servers-secret")
    for env in (child_env(), child_environment(OMP_NUM_THREADS="1")):
        assert "DIFFUSION_ENGINE_TOKEN" not in env and env.get("PATH") == os.environ.get("PATH")
        shown = subprocess.run([sys.executable, "-c", "import os; print(dict(os.environ))"], env=env,
                               capture_output=True, text=True, timeout=120, check=True).stdout
        assert "the-servers-secret" not in shown
