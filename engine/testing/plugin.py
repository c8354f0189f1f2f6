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
