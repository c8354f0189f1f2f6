"""The FLUX.3 family plugin (``Flux3ModularPipeline``, ``Flux3DistilledModularPipeline``: modular only)."""
