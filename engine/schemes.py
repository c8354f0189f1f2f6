"""Plugin API 1's spelling of :mod:`engine.contract.schemes`: the same module object.

Kept so plugins written for API 1 (``from engine.schemes import ...``) keep working;
new code imports :mod:`engine.contract.schemes`.
"""

import sys

from engine.contract import schemes as _module

sys.modules[__name__] = _module
