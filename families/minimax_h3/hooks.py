"""Entry point of the MiniMax-H3 family plugin: registers its table.

Every hook is answered from the table by the engine's built-in table plugin: the runtime
loads a modular pipeline from its ``modular_model_index.json`` (:mod:`engine.runtime.modular`),
and the clip's sound is read by the engine's default (``result.audio`` at the rate the call
gives, 32 kHz stereo).
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.minimax_h3.table import MINIMAX_H3

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(MINIMAX_H3)
