"""The rooms of the engine and the arrows allowed between them: imports go down, never up.

Every ``import engine...`` in ``engine/`` (top-level and lazy, at any depth) is read
with ``ast`` and mapped to its room by the map in :mod:`engine.rooms` (which renders
docs/architecture.md's room table); an arrow the map does not allow fails here,
naming the file and line. The faces' own rule (they reach only the facade, the
vocabulary and the errors) is ``tests/house/test_one_door.py``; this is the same rule below
them: the runtime never imports the trainer, the policy never the runtime, the
plugin contract nothing that loads a model.

``DEBT`` lists the upward arrows that exist today and are to go (none now: the
runtime hooks' defaults are the runtime's, so the registry's table plugin reaches
no runtime). It may only shrink: an arrow listed there that no import makes any
more fails too, so the entry is removed with the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from engine.rooms import ALLOWED, DEBT, MODULES, PACKAGES, page_with_rooms, room_of as room

ROOT = Path(__file__).resolve().parents[2] / "engine"


def arrows() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        if module == "engine":
            module = "engine.__init__"
        source = room(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "engine" else [f"engine.{a.name}" for a in node.names]
            for name in names:
                if name.split(".")[0] != "engine" or name == "engine":
                    continue
                target = room(name)
                if target != source:
                    found.setdefault((source, target), []).append(f"{relative}.py:{node.lineno} imports {name}")
    return found


def test_every_module_is_in_a_room() -> None:
    listed = set().union(*MODULES.values())
    assert {path.stem for path in ROOT.glob("*.py")} == listed  # a new top-level module is given its room
    assert {path.name for path in ROOT.iterdir() if (path / "__init__.py").exists()} == PACKAGES


def test_imports_only_go_down() -> None:
    wrong = {arrow: where for arrow, where in arrows().items()
             if arrow[1] not in ALLOWED[arrow[0]] and arrow not in DEBT}
    assert not wrong, "\n".join(line for where in wrong.values() for line in where)


def test_the_debt_only_shrinks() -> None:
    paid = DEBT - set(arrows())
    assert not paid, f"no import makes {sorted(paid)} any more: remove it from DEBT"


def test_the_request_vocabulary_is_a_leaf() -> None:
    """``import engine.requests`` (what every face imports first) loads no decision and no machinery."""
    import subprocess
    import sys

    code = ("import sys, engine.requests; print(' '.join(m for m in sys.modules if m.startswith('engine.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "engine.requests.inference" in loaded
    # the pydantic models load when first used (a light command never asks for them)
    assert "engine.requests.bodies" not in loaded and "engine.requests.training" not in loaded
    code = ("import sys, engine.requests; engine.requests.GenerateBody, engine.requests.TrainingConfig; "
            "print(' '.join(m for m in sys.modules if m.startswith('engine.')))")
    used = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "engine.requests.bodies" in used and "engine.requests.training" in used
    below = [m for m in used if m.split(".")[1] in {"policy", "preflight", "training", "runtime", "service"}]
    assert not below, below


def test_reading_records_back_loads_no_pydantic_on_the_light_paths() -> None:
    """The hardware probe reads its GEMM cache through engine.stored; importing them loads no
    pydantic (it comes with the first record validated), so the probe stays as light as it was."""
    import subprocess
    import sys

    code = "import sys, engine.stored, engine.hardware.probe; print('pydantic' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_plugin_api_1_spellings_are_the_contract_modules_themselves() -> None:
    """``from engine.types import FamilySpec`` (plugin API 1) gets the contract's own class: one
    module object under two names, so a patch or an ``isinstance`` through either holds for both."""
    import importlib
    import warnings

    from engine.deprecation import PluginDeprecationWarning

    for name in sorted(MODULES["alias"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginDeprecationWarning)  # the register's row warns; tested there
            alias = importlib.import_module(f"engine.{name}")
        assert alias is importlib.import_module(f"engine.contract.{name}"), name


def module_imports() -> dict[str, set[str]]:
    """Each engine module -> the engine modules it imports, at any depth of the file (a lazy
    import too), but not under ``if TYPE_CHECKING`` (never run). ``from engine.cli import images``
    imports the module ``engine.cli.images``; ``from engine.x import name`` imports ``engine.x``."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        unseen = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
                  for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in unseen:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = submodules or [node.module]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_file_level_import_cycle() -> None:
    """No two engine modules import each other, however indirectly (a lazy import counts:
    it is still an arrow a maintainer must hold in mind)."""
    graph = module_imports()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_architecture_page_draws_the_rooms_this_test_checks() -> None:
    """docs/architecture.md's room table is rendered from the same map (python -m engine.rooms)."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert page == page_with_rooms(page), "docs/architecture.md's rooms drifted: run python -m engine.rooms"
    assert set(ALLOWED) == set(MODULES) | PACKAGES  # every room drawn, and only those
    assert room("engine.table_plugin") == "contract"
