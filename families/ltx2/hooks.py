"""Entry point of the LTX-2 family plugin: registers its table.

Every hook is answered from the table by the engine's built-in table plugin: the clip's
sound is read by the engine's default (``result.audio`` at ``VideoSpec.audio_rate``) and the
request's fps reaches the pipeline's ``frame_rate``, which also sets the sound's length.
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION
from engine.contract.types import FamilySpec
from families.ltx2.table import LTX2

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = PLUGIN_API_VERSION  # built in: the engine's own API, named once


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(LTX2)
