"""A local server protects itself like Jupyter does: it answers only its own names
(DNS rebinding), a page on another site cannot change its state (Origin,
Sec-Fetch-Site, simple content types), CORS stays closed, a token is never
logged, and two Authorization headers are refused. A real server on loopback."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def tokenless(tiny_pipeline: Callable[[str], Path]) -> Iterator[tuple[str, Engine]]:
    """A tokenless loopback server with a tiny pipeline loaded: what a cross-site page would unload."""
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    engine.images.load(str(tiny_pipeline("sdxl")))
    settings = ServerSettings(model_roots=(tiny_pipeline("sdxl").parent,), extra_hosts=("proxy.example",))
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine


def loaded(url: str) -> bool:
    return httpx.get(f"{url}/v1/images/status").json()["pipeline"] is not None


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io", "10.0.0.1"])
def test_a_rebound_name_is_refused(tokenless: tuple[str, Engine], host: str) -> None:
    url, _ = tokenless
    for method, path in (("GET", "/v1/families"), ("POST", "/v1/images/unload"), ("GET", "/")):
        response = httpx.request(method, f"{url}{path}", headers={"Host": host, "Content-Type": "application/json"})
        assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed", response.text
    assert loaded(url)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "PROXY.example:443"])
def test_loopback_names_and_allowed_hosts_are_answered(tokenless: tuple[str, Engine], host: str) -> None:
    url, _ = tokenless
    port = url.rsplit(":", 1)[1]
    response = httpx.get(f"{url}/v1/families", headers={"Host": host if ":" in host else f"{host}:{port}"})
    assert response.status_code == 200


@pytest.mark.parametrize(("headers", "content", "status", "code"), [
    ({"Content-Type": "text/plain"}, b"{}", 415, "unsupported_media_type"),  # a cross-site "simple" request
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"a=1", 415, "unsupported_media_type"),
    ({}, b"", 415, "unsupported_media_type"),  # fetch(url, {method: "POST", mode: "no-cors"})
    ({"Content-Type": "application/json", "Origin": "http://attacker.example"}, b"{}", 403, "cross_origin_refused"),
    ({"Content-Type": "application/json", "Origin": "null"}, b"{}", 403, "cross_origin_refused"),
    ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, b"{}", 403, "cross_origin_refused"),
])
@pytest.mark.parametrize("path", ["/v1/images/unload", "/v1/training/cancel", "/v1/images/jobs"])
def test_cross_site_state_changes_are_refused(
    tokenless: tuple[str, Engine], headers: dict[str, str], content: bytes, status: int, code: str, path: str
) -> None:
    url, _ = tokenless
    response = httpx.post(f"{url}{path}", headers=headers, content=content)
    assert response.status_code == status and response.json()["error"]["code"] == code, response.text
    assert loaded(url)


def test_a_cross_site_multipart_edit_is_refused(tokenless: tuple[str, Engine]) -> None:
    url, engine = tokenless
    response = httpx.post(f"{url}/v1/images/edits", headers={"Origin": "http://attacker.example"},
                          files={"image": ("a.png", b"\x89PNG", "image/png")}, data={"prompt": "x"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "cross_origin_refused"
    assert loaded(url)


def test_the_servers_own_page_and_plain_clients_still_work(tokenless: tuple[str, Engine]) -> None:
    url, _ = tokenless
    same_origin = {"Origin": url, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}
    assert httpx.post(f"{url}/v1/training/cancel", headers=same_origin).json()["error"]["code"] == "not_training"
    plain = httpx.post(f"{url}/v1/training/cancel", json={})  # a client that is not a browser
    assert plain.status_code == 409 and plain.json()["error"]["code"] == "not_training"


def test_cors_stays_closed(tokenless: tuple[str, Engine]) -> None:
    url, _ = tokenless
    preflight = httpx.options(f"{url}/v1/images/unload", headers={
        "Origin": "http://attacker.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    simple = httpx.get(f"{url}/v1/families", headers={"Origin": "http://attacker.example"})
    assert "access-control-allow-origin" not in simple.headers


# -- with a token ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded() -> Iterator[str]:
    engine = Engine(registry=load_registry(), hardware=probe(verify=False))
    server = LiveServer(create_app(engine, ServerSettings(token=TOKEN)))
    server._server.config.log_level = "info"
    with server as url:
        yield url


def test_two_authorization_headers_are_refused(guarded: str) -> None:
    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {TOKEN}")]
    response = httpx.get(f"{guarded}/v1/families", headers=headers)
    assert response.status_code == 400 and "more than one Authorization" in response.json()["error"]["message"]
    assert httpx.get(f"{guarded}/v1/families", headers=[headers[1]]).status_code == 200


def test_a_refused_query_token_is_never_logged(guarded: str, caplog: pytest.LogCaptureFixture) -> None:
    access = logging.getLogger("uvicorn.access")
    access.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        refused = httpx.get(f"{guarded}/v1/families?token=guessed-wrong&x=1")
        events = httpx.get(f"{guarded}/v1/training/events?token=also-wrong")
    assert refused.status_code == events.status_code == 401
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "uvicorn.access")
    assert "/v1/families?x=1" in logged and "/v1/training/events" in logged
    assert "guessed-wrong" not in logged and "also-wrong" not in logged and "token=" not in logged
