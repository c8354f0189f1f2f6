"""Plugin API 1's spelling of :mod:`engine.contract.plugins`: the same module object.

Kept so plugins written for API 1 (``from engine.plugins import ...``) keep working;
new code imports :mod:`engine.contract.plugins`.
"""

import sys

from engine.contract import plugins as _module

sys.modules[__name__] = _module
