"""diffusion-engine: a hardware-aware engine for diffusion image models.

Importing the package is light: the plugin contract, hardware profiles and
the policy layer import no torch. Torch-dependent code lives under
``engine.runtime`` and ``engine.training`` and in each family's runtime
module, imported only when a model is loaded or a run starts.

    from engine import Engine
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.version import __version__

__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from engine.service.facade import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported on first use, so `import engine` stays light
        from engine.service.facade import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
