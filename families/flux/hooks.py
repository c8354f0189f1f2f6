"""Entry point of the flux family plugin: registers its table.

Every per-concern hook is answered from the table by the engine's built-in
table plugin; this module adds code only where a table cannot say it.
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.types import FamilySpec
from engine.contract.plugin_api import PLUGIN_API_VERSION
from families.flux.table import FLUX


#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once

@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(FLUX)
