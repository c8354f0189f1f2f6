"""Schema-driven fuzzing of the live server: bounded examples per operation, no 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from engine.hardware.presets import preset
from engine.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service import Engine
from tests.support import LiveServer

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    root = tmp_path_factory.mktemp("fuzz")
    roots = {name: root / name for name in ("models", "datasets", "outputs")}
    for folder in roots.values():
        folder.mkdir()
    # A preset machine: whatever the fuzzer asks is planned for an RTX 4090 and
    # refused before anything would touch this machine's CPU for real.
    engine = Engine(registry=load_registry(), hardware=preset("rtx4090"), runs_dir=roots["outputs"])
    app = create_app(engine, ServerSettings(
        model_roots=(roots["models"],), dataset_roots=(roots["datasets"],),
        output_roots=(roots["outputs"],), token=TOKEN,
    ))
    with LiveServer(app) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        schema.config.update(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})
        yield schema


def test_no_operation_answers_with_a_server_error(api_schema: schemathesis.BaseSchema) -> None:
    """Each operation of the OpenAPI schema, 25 generated requests each (derandomised)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 13
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case: schemathesis.Case) -> None:
            nonlocal calls
            calls += 1
            response = case.call()
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["code"] and error["message"]

        check()
    assert calls >= 100
