"""Entry point of the Krea 2 family plugin: registers its table.

Every hook is answered from the table by the engine's built-in table plugin.
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.krea2.table import KREA2

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(KREA2)
