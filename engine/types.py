"""Plugin API 1's spelling of :mod:`engine.contract.types`: the same module object.

Kept so plugins written for API 1 (``from engine.types import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.types`.
"""

import sys

from engine.contract import types as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.types", "engine.contract.types", kind="module"), stacklevel=2)
