"""The plugin contract: what a model family is, and how the engine finds and asks it.

Torch-free, and the lowest room a family touches:

- :mod:`engine.contract.hookspecs`: the ``engine_*`` hooks a family implements;
- :mod:`engine.contract.plugins`: loading the registry from entry points;
- :mod:`engine.contract.types` and :mod:`engine.contract.family_sections`: the
  family's spec and its table sections (sizes, deny lists, LoRA layout, ...);
- :mod:`engine.contract.family_helpers`, :mod:`engine.contract.family_runtime`:
  helpers a family's table and runtime module call;
- :mod:`engine.contract.plugin_api`: the API version and its deprecations;
- :mod:`engine.contract.schemes`: the quantisation schemes a table may name.

The typed errors and their stable codes (:mod:`engine.errors`) sit one room
lower, since the hardware probe raises them too.

Plugin API 1 spelled these ``engine.types``, ``engine.hookspecs``, ...; those
paths stay as aliases of the same modules (``engine.types is engine.contract.types``).
"""
