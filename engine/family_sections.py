"""Plugin API 1's spelling of :mod:`engine.contract.family_sections`: the same module object.

Kept so plugins written for API 1 (``from engine.family_sections import ...``) keep working, with a
warning the first time it is imported (a row of :mod:`engine.deprecation`'s register);
new code imports :mod:`engine.contract.family_sections`.
"""

import sys

from engine.contract import family_sections as _module
from engine.deprecation import deprecate, register

sys.modules[__name__] = _module
deprecate(register("engine.family_sections", "engine.contract.family_sections", kind="module"), stacklevel=2)
