"""pytest plugin: fixtures for testing diffusion-engine family plugins."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.plugins import Registry
from engine.testing.contract import fresh_registry
from engine.testing.run import RunReport, run_model


@pytest.fixture
def engine_registry() -> Registry:
    """A registry freshly loaded from the installed entry points."""
    return fresh_registry()


@pytest.fixture
def engine_run_model(engine_registry: Registry, tmp_path: Path) -> Callable[[str], RunReport]:
    """``run(family_name)``: the kit's model run (load the tiny pipeline through
    the engine, generate, train two LoRA steps, reload the LoRA), for tests of
    a family's own behaviour; read ``report.failure``, ``report.plan`` and
    ``report.capabilities``."""

    def run(family_name: str) -> RunReport:
        return run_model(engine_registry, engine_registry.family(family_name), tmp_path / family_name)

    return run


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_pipeline(family, checkpoint=None)``: the family's tiny random-weight pipeline
    folder, built once per session through its ``engine_build_tiny_pipeline`` (``checkpoint``:
    that checkpoint's own, where its pipeline class differs from the family's). A family's own
    suite, beside the family, takes it as the engine's suite does."""
    from engine.contract.plugins import load_registry

    registry = load_registry()
    built: dict[tuple[str, str | None], Path] = {}

    def get(family: str, checkpoint: str | None = None) -> Path:
        if (family, checkpoint) not in built:
            spec = registry.family(family)
            folder = tmp_path_factory.mktemp(f"tiny-{family}") / (checkpoint or family)
            built[family, checkpoint] = registry.build_tiny_pipeline(
                spec, folder, spec.checkpoint(checkpoint) if checkpoint else None)
        return built[family, checkpoint]

    return get
