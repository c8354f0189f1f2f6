"""Plugin API 1's spelling of :mod:`engine.contract.schemes`: the same module object.

Kept so plugins written for API 1 (``from engine.schemes import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.schemes`.
"""

import sys

from engine.contract import schemes as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.schemes", "engine.contract.schemes", kind="module"), stacklevel=2)
