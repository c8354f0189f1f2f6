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
"""

from engine.testing.contract import FamilyContract, build_tiny_or_fail, fresh_registry
from engine.testing.run import RunReport, run_model

__all__ = ["FamilyContract", "RunReport", "build_tiny_or_fail", "fresh_registry", "run_model"]
