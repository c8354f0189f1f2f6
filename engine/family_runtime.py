"""Plugin API 1's spelling of :mod:`engine.contract.family_runtime`: the same module object.

Kept so plugins written for API 1 (``from engine.family_runtime import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.family_runtime`.
"""

import sys

from engine.contract import family_runtime as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.family_runtime", "engine.contract.family_runtime", kind="module"), stacklevel=2)
