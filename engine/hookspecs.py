"""Plugin API 1's spelling of :mod:`engine.contract.hookspecs`: the same module object.

Kept so plugins written for API 1 (``from engine.hookspecs import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.hookspecs`.
"""

import sys

from engine.contract import hookspecs as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.hookspecs", "engine.contract.hookspecs", kind="module"), stacklevel=2)
