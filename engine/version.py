"""The engine's release number, in one place below every room.

The package metadata (pyproject) and :mod:`engine.deprecation` read it: a
deprecated spelling names the release that removes it, and a test fails once
that release arrives (see :func:`engine.deprecation.deprecate`).
"""

from __future__ import annotations

__version__ = "0.2.0"
