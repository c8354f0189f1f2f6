"""Entry point of the qwen_image family plugin: registers its table.

Every per-concern hook is answered from the table by the engine's built-in
table plugin; this module adds code only where a table cannot say it.
"""

from collections.abc import Callable

from engine.hookspecs import hookimpl
from engine.types import FamilySpec
from families.qwen_image.table import QWEN_IMAGE


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(QWEN_IMAGE)
