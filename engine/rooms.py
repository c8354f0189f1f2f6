"""The rooms of the engine, what each holds, and the arrows allowed between them: the one map.

Imports go down, never up. ``tests/house/test_layers.py`` maps every ``import engine...`` in
``engine/`` to its room with this table and fails on an arrow it does not allow;
``docs/architecture.md``'s room table is rendered from it (``python -m engine.rooms``),
and a test compares the page with a fresh render, so the map cannot drift from the code.
Standard library only.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from engine.generated_docs import DOCS


@dataclass(frozen=True)
class Room:
    """One room: where it lives, what it holds, and the rooms it may import."""

    name: str
    where: str
    holds: str
    imports: frozenset[str]


#: Packages of ``engine/``, each its own room (by its name).
PACKAGES = frozenset({"cli", "server", "service", "requests", "policy", "preflight", "runtime", "training",
                      "hardware", "contract", "testing"})
#: Top-level modules of ``engine/``, by room.
MODULES: dict[str, frozenset[str]] = {
    "base": frozenset({"errors", "error_catalogue", "generated_docs", "logs", "places", "network", "version",
                       "deprecation", "stored", "rooms"}),
    "alias": frozenset({"types", "hookspecs", "plugins", "plugin_api", "schemes", "family_sections",
                        "family_helpers", "family_runtime"}),
    # the hooks a family's table answers: the contract's own defaults (the runtime's are the runtime's)
    "contract": frozenset({"table_plugin"}),
    "facade": frozenset({"__init__"}),
    "main": frozenset({"__main__"}),
}
_BELOW_SERVICE = frozenset({"requests", "runtime", "training", "policy", "preflight", "hardware", "contract", "base"})

#: Top to bottom, as the docs draw them.
ROOMS: tuple[Room, ...] = (
    Room("main", "engine/__main__.py", "`python -m engine`", frozenset({"cli"})),
    Room("cli", "engine/cli/", "the terminal face: flags into one request record, then the facade",
         frozenset({"facade", "requests", "server", "base"})),
    Room("server", "engine/server/", "the HTTP face (FastAPI) and the web page: JSON into one request record",
         frozenset({"facade", "requests", "base"})),
    Room("facade", "engine/__init__.py", "`Engine` and the names an app imports", frozenset({"service", "base"})),
    Room("testing", "engine/testing/", "the contract kit, tiny datasets and memory tools for plugin authors",
         _BELOW_SERVICE | {"service"}),
    Room("service", "engine/service/", "`Engine`'s parts (images, videos, training, datasets, gallery), the GPU "
         "arbiter, checks that return tickets", _BELOW_SERVICE),
    Room("training", "engine/training/", "the trainer loop, its child process, run records and the lock",
         frozenset({"runtime", "policy", "preflight", "requests", "contract", "hardware", "base"})),
    Room("runtime", "engine/runtime/", "the plan applied with torch, diffusers, torchao: load, quantise, generate",
         frozenset({"policy", "preflight", "requests", "contract", "hardware", "base"})),
    Room("preflight", "engine/preflight/", "what a path is and its sizes, from headers: cheap, no torch",
         frozenset({"policy", "requests", "contract", "hardware", "base"})),
    Room("policy", "engine/policy/", "pure decisions with their reasons: no torch",
         frozenset({"requests", "contract", "hardware", "base"})),
    Room("requests", "engine/requests/", "the request vocabulary: every record a face builds or the engine takes",
         frozenset({"hardware", "contract", "base"})),
    Room("contract", "engine/contract/, table_plugin.py", "hookspecs, the registry, family types and sections, "
         "schemes, the hooks a family's table answers",
         frozenset({"hardware", "base"})),
    Room("hardware", "engine/hardware/", "the machine as plain data: probe and presets", frozenset({"base"})),
    Room("alias", "engine/types.py, hookspecs.py, ...", "plugin API 1's spellings of the contract's modules "
         "(each a row of the register of old spellings)", frozenset({"contract", "base"})),
    Room("base", "engine/errors.py, stored.py, places.py, ...", "errors and their catalogue, records read back, "
         "where things are, the loopback test, the release and its register of old spellings, this map", frozenset()),
)
ALLOWED: dict[str, frozenset[str]] = {room.name: room.imports for room in ROOMS}
#: Upward arrows that exist today, to be removed (and then removed from here). None: the last
#: (the registry's table plugin reaching the runtime for its defaults) went when the runtime
#: hooks' defaults moved to the runtime (engine.runtime.family_hooks).
DEBT: frozenset[tuple[str, str]] = frozenset()

#: Where the rendered table sits in docs/architecture.md.
START, END = "<!-- rooms: rendered by python -m engine.rooms -->", "<!-- /rooms -->"


def room_of(module: str) -> str:
    """The room of a dotted ``engine...`` module name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"
    if parts[1] in PACKAGES:
        return parts[1]
    # ``from engine import Engine, __version__``: a name the package itself exports
    return next((name for name, members in MODULES.items() if parts[1] in members), "facade")


def render() -> str:
    """The room table, top to bottom, with what each room may import and the debt."""
    lines = [START, "", "| room | where | holds | may import |", "|---|---|---|---|"]
    for room in ROOMS:
        below = ", ".join(name for name in (r.name for r in ROOMS) if name in room.imports) or "nothing"
        lines.append(f"| {room.name} | `{room.where}` | {room.holds} | {below} |")
    debt = "; ".join(f"{a} -> {b}" for a, b in sorted(DEBT)) or "none"
    lines += ["", f"Upward arrows still to remove (the debt, which may only shrink): {debt}.", "", END]
    return "\n".join(lines)


def page_with_rooms(page: str) -> str:
    """``page`` (docs/architecture.md) with its room table rendered anew."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"the page has no {START} ... {END} block")
    return pattern.sub(lambda _: render(), page)


def main(argv: list[str]) -> int:
    """Render the room table into docs/architecture.md (or the page given)."""
    from pathlib import Path

    target = Path(argv[0]) if argv else DOCS / "architecture.md"
    target.write_text(page_with_rooms(target.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
