"""diffusion-engine: a hardware-aware engine for diffusion image models.

Importing the package is light: the plugin contract, hardware profiles and
the policy layer import no torch. Torch-dependent code lives under
``engine.runtime`` and ``engine.training`` and in each family's runtime
module, imported only when a model is loaded or a run starts.
"""

__version__ = "0.1.0"
