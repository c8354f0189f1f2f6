"""Plugin API 1's spelling of :mod:`engine.contract.family_sections`: the same module object.

Kept so plugins written for API 1 (``from engine.family_sections import ...``) keep working;
new code imports :mod:`engine.contract.family_sections`.
"""

import sys

from engine.contract import family_sections as _module

sys.modules[__name__] = _module
