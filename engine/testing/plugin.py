"""pytest plugin: fixtures for testing diffusion-engine family plugins."""

from __future__ import annotations

import pytest

from engine.plugins import Registry
from engine.testing.contract import fresh_registry


@pytest.fixture
def engine_registry() -> Registry:
    """A registry freshly loaded from the installed entry points."""
    return fresh_registry()
