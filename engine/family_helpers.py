"""Plugin API 1's spelling of :mod:`engine.contract.family_helpers`: the same module object.

Kept so plugins written for API 1 (``from engine.family_helpers import ...``) keep working;
new code imports :mod:`engine.contract.family_helpers`.
"""

import sys

from engine.contract import family_helpers as _module

sys.modules[__name__] = _module
