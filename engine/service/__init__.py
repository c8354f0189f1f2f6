"""The facade and its parts: :class:`Engine`, composed of what it owns.

- :mod:`engine.service.facade`: :class:`Engine` itself;
- :mod:`engine.service.catalog`, :mod:`engine.service.training`,
  :mod:`engine.service.datasets`: its parts (the catalogue's questions, the
  training jobs, the dataset library's jobs);
- :mod:`engine.service.residency`: what is resident on the device, and evicting it;
- :mod:`engine.service.dataset_library`, :mod:`engine.service.doctor`: the
  dataset manager's folder and the machine's check-up.

``Engine`` is imported on first use, as from :mod:`engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.service.facade import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from engine.service.facade import Engine

        return Engine
    raise AttributeError(f"module 'engine.service' has no attribute {name!r}")
