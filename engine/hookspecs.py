"""Plugin API 1's spelling of :mod:`engine.contract.hookspecs`: the same module object.

Kept so plugins written for API 1 (``from engine.hookspecs import ...``) keep working;
new code imports :mod:`engine.contract.hookspecs`.
"""

import sys

from engine.contract import hookspecs as _module

sys.modules[__name__] = _module
