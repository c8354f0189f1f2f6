"""The version floors diffusers' attention dispatcher enforces, read from the installed diffusers.

diffusers enables an optional kernel only from a version it names in
``models/attention_dispatch.py`` (``_REQUIRED_SAGE_VERSION = "2.1.1"``, the
``kernels`` checks of its hub backends), and refuses an older package at
``set_attention_backend``. A floor written here by hand drifts with every
diffusers release (ours said sage 1.0.6 while the dispatcher wanted 2.1.1), so
the floors are read from the installed file's text, without importing
diffusers (that would pull torch, and fix diffusers' kernel flags before an
install could change them). A floor that cannot be read is left out: the plan
then installs the plain package and says the floor is unknown.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping

#: Our backend name -> the dispatcher constant that holds its floor.
_CONSTANTS: Mapping[str, str] = {
    "flash": "_REQUIRED_FLASH_VERSION",
    "sage": "_REQUIRED_SAGE_VERSION",
    "xformers": "_REQUIRED_XFORMERS_VERSION",
}
#: The hub backends' ``kernels`` floor: the general check, then FlashAttention-4's own.
_KERNELS_FLOOR = re.compile(r'not is_kernels_version\(">=", "([^"]+)"\)')
_FLASH4_FLOOR = re.compile(r'FLASH_4_HUB and not is_kernels_version\(">=", "([^"]+)"\)')


def dispatcher_source() -> str | None:
    """The installed diffusers' ``models/attention_dispatch.py``, as text (None: not found)."""
    spec = importlib.util.find_spec("diffusers")
    for location in (spec.submodule_search_locations or ()) if spec else ():
        try:
            with open(os.path.join(location, "models", "attention_dispatch.py"), encoding="utf-8") as handle:
                return handle.read()
        except OSError:
            continue
    return None


def parse_floors(source: str) -> dict[str, str]:
    """Our backend name -> the minimum version the dispatcher in ``source`` accepts."""
    floors: dict[str, str] = {}
    for backend, constant in _CONSTANTS.items():
        match = re.search(rf'^{constant}\s*=\s*"([^"]+)"', source, re.MULTILINE)
        if match:
            floors[backend] = match.group(1)
    general = _KERNELS_FLOOR.search(source)
    if general:
        floors["flash3"] = general.group(1)
    flash4 = _FLASH4_FLOOR.search(source)
    if flash4 or general:
        floors["flash4"] = (flash4 or general).group(1)  # type: ignore[union-attr]
    return floors


@functools.cache
def installed_attention_floors() -> tuple[tuple[str, str], ...]:
    """(backend, floor) pairs of the installed diffusers; empty where it cannot be read."""
    source = dispatcher_source()
    return tuple(sorted(parse_floors(source).items())) if source else ()


def installed_versions(packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(import name, version) of each installed package among ``packages`` (its distribution's
    version; import names and distribution names agree for the attention packages but
    ``flash_attn``, whose distribution is ``flash-attn``)."""
    versions = []
    for package in packages:
        try:
            versions.append((package, importlib.metadata.version(package.replace("_", "-"))))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(versions)
