"""Test helpers for family authors: the family contract suite.

Every family, built-in or third-party, runs the same contract from its own
``tests/`` folder::

    from engine.testing import FamilyContract

    class TestMyFamily(FamilyContract):
        family_name = "my_family"

The kit runs the model (``run_model``: load the tiny pipeline through the
engine, generate, train two LoRA steps, reload the LoRA). The pytest plugin
(``engine.testing.plugin``, installed as a ``pytest11`` entry point) adds the
``engine_registry`` fixture.

The kit's names are imported on first use, not with the package: its helpers
(``engine.testing.datasets``) must work in an install without pytest.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "FamilyContract": "engine.testing.contract",
    "build_tiny_or_fail": "engine.testing.contract",
    "fresh_registry": "engine.testing.contract",
    "RunReport": "engine.testing.run",
    "run_model": "engine.testing.run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.testing' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
