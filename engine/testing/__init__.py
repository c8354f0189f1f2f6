"""Test helpers for family authors: the family contract suite.

Every family, built-in or third-party, runs the same contract from its own
``tests/`` folder::

    from engine.testing import FamilyContract

    class TestMyFamily(FamilyContract):
        family_name = "my_family"

The pytest plugin (``engine.testing.plugin``, installed as a ``pytest11``
entry point) adds the ``engine_registry`` fixture.
"""

from engine.testing.contract import FamilyContract, fresh_registry

__all__ = ["FamilyContract", "fresh_registry"]
