"""Plugin API 1's spelling of :mod:`engine.contract.plugin_api`: the same module object.

Kept so plugins written for API 1 (``from engine.plugin_api import ...``) keep working;
new code imports :mod:`engine.contract.plugin_api`.
"""

import sys

from engine.contract import plugin_api as _module

sys.modules[__name__] = _module
