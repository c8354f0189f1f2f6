"""Plugin API 1's spelling of :mod:`engine.contract.family_runtime`: the same module object.

Kept so plugins written for API 1 (``from engine.family_runtime import ...``) keep working;
new code imports :mod:`engine.contract.family_runtime`.
"""

import sys

from engine.contract import family_runtime as _module

sys.modules[__name__] = _module
