"""Entry point of the HunyuanVideo 1.5 family plugin: registers its table.

Every per-concern hook is answered from the table by the engine's built-in table
plugin (the guider's guidance and the missing step callback are table facts the
engine handles); this module adds code only where a table cannot say it.
"""

from collections.abc import Callable

from engine.contract.hookspecs import hookimpl
from engine.contract.types import FamilySpec
from families.hunyuan_video.table import HUNYUAN_VIDEO

#: The plugin API this plugin is written for (engine.contract.plugin_api).
ENGINE_PLUGIN_API = 1


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(HUNYUAN_VIDEO)
