"""Schema-driven fuzzing of the live server: bounded examples per operation, valid
and invalid bodies, no 5xx, and every error in the one ``{"error": {"code", "message"}}`` shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from engine.hardware.presets import preset
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import LiveServer

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzz")
    roots = {name: root / name for name in ("models", "datasets", "outputs")}
    for folder in roots.values():
        folder.mkdir()
    # A preset machine: whatever the fuzzer asks is planned for an RTX 4090 and
    # refused before anything would touch this machine's CPU for real.
    engine = Engine(registry=load_registry(), hardware=preset("rtx4090"), runs_dir=roots["outputs"])
    app = create_app(engine, ServerSettings(
        model_roots=(roots["models"],), dataset_roots=(roots["datasets"],),
        output_roots=(roots["outputs"],), token=TOKEN, max_body_bytes=64 * 1024,
    ))
    with LiveServer(app) as url:
        yield url


def _schema(url: str, mode: GenerationMode, token: str | None) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    schema.config.update(base_url=url, headers=headers)
    schema.config.generation.update(modes=[mode])
    return schema


def _check_response(case: schemathesis.Case, response: httpx.Response) -> None:
    assert response.status_code < 500, (case.method, case.path, repr(case.body)[:300], response.text[:500])
    if response.status_code >= 400:
        payload = response.json()
        assert list(payload) == ["error"] and set(payload["error"]) == {"code", "message"}, payload
        assert payload["error"]["code"] and payload["error"]["message"]
        assert len(payload["error"]["message"]) <= 1100


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "examples"), [(GenerationMode.POSITIVE, 10), (GenerationMode.NEGATIVE, 10)]
)
def test_no_operation_answers_with_a_server_error(live: str, mode: GenerationMode, examples: int) -> None:
    """Each operation of the OpenAPI schema, a bounded number of generated requests (derandomised)."""
    operations = [result.ok() for result in _schema(live, mode, TOKEN).get_all_operations()]
    assert len(operations) >= 13
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case: schemathesis.Case) -> None:
            nonlocal calls
            calls += 1
            _check_response(case, case.call())

        check()
    assert calls >= 5 * len(operations)


def test_without_the_token_every_operation_is_a_401_in_the_shape(live: str) -> None:
    for result in _schema(live, GenerationMode.POSITIVE, None).get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case: schemathesis.Case) -> None:
            response = case.call()
            _check_response(case, response)
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"

        check()
