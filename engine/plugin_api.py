"""Plugin API 1's spelling of :mod:`engine.contract.plugin_api`: the same module object.

Kept so plugins written for API 1 (``from engine.plugin_api import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.plugin_api`.
"""

import sys

from engine.contract import plugin_api as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.plugin_api", "engine.contract.plugin_api", kind="module"), stacklevel=2)
