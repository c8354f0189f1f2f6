"""The sd3 plugin's own tests: the engine's contract kit, model run included.

Run with the package installed (``pip install -e .``): ``pytest tests``.
"""

from engine.testing import FamilyContract


class TestSd3Contract(FamilyContract):
    family_name = "sd3"
