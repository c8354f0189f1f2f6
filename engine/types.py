"""Plugin API 1's spelling of :mod:`engine.contract.types`: the same module object.

Kept so plugins written for API 1 (``from engine.types import ...``) keep working;
new code imports :mod:`engine.contract.types`.
"""

import sys

from engine.contract import types as _module

sys.modules[__name__] = _module
