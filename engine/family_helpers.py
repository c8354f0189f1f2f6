"""Plugin API 1's spelling of :mod:`engine.contract.family_helpers`: the same module object.

Kept so plugins written for API 1 (``from engine.family_helpers import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.family_helpers`.
"""

import sys

from engine.contract import family_helpers as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.family_helpers", "engine.contract.family_helpers", kind="module"), stacklevel=2)
