"""The spellings of the facade before its parts: they still work, they warn, and they go on time.

Each old method of :class:`~engine.Engine` (``engine.load``, ``engine.start_training``,
``engine.datasets()``...) is a delegate to its part that warns with
:class:`~engine.deprecation.EngineDeprecationWarning`, naming the new spelling and the
release that removes it; once the package reaches that release, the delegate raises
instead (as diffusers' ``deprecate`` does), so the release that forgot to delete it fails here.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from engine import Engine
from engine.deprecation import (SHIMS, EngineDeprecationWarning, ShimExpired, deprecate, load_register,
                                page_with_register, version_tuple)
from engine.hardware.presets import preset
from engine.deprecation import moved as Moved
from engine.version import __version__

ROOT = Path(__file__).resolve().parents[2]
MOVED = {name: value for name, value in vars(Engine).items() if isinstance(value, Moved)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    home = tmp_path_factory.mktemp("deprecated")
    return Engine(hardware=preset("rtx4090"), runs_dir=home / "runs", dataset_roots=[home / "datasets"])


def test_every_old_method_names_a_method_of_a_part_with_the_same_parameters(engine: Engine) -> None:
    assert len(MOVED) >= 38
    for name, moved in MOVED.items():
        part, new_name = moved.path.split(".")
        target = getattr(getattr(engine, part), new_name)
        assert callable(target), name
        assert moved.shim is not None and moved.shim.new == f"Engine.{part}.{new_name}()"
        assert inspect.signature(getattr(engine, name)) == inspect.signature(target), name


@pytest.mark.parametrize(("old", "new", "call"), [
    ("families", "catalog.families", lambda e: e.families()),
    ("plans", "images.plans", lambda e: e.plans()),
    ("plan", "images.plan", lambda e: e.plan(family="sdxl")),
    ("runs", "training.runs", lambda e: e.runs()),
    ("train_info", "training.info", lambda e: e.train_info()),
    ("dataset_in_use", "datasets.in_use", lambda e: e.dataset_in_use("/nowhere")),
])
def test_an_old_method_warns_with_its_new_spelling_and_answers_as_the_new_one(
    engine: Engine, old: str, new: str, call: object
) -> None:
    with pytest.warns(EngineDeprecationWarning, match=rf"Engine\.{old}\(\) is deprecated .* 0\.3\.0; use Engine\.{new}\(\)") as seen:
        answer = call(engine)  # type: ignore[operator]
    assert seen[0].filename == __file__  # the warning points at the caller's line, not the shim
    assert _plain(answer) == _plain(call(_Namespaced(engine)))  # type: ignore[operator]


def test_the_old_check_load_still_returns_a_plan_the_new_one_a_ticket(engine: Engine, tiny_pipeline) -> None:  # type: ignore[no-untyped-def]
    folder = str(tiny_pipeline("sdxl"))
    ticket = engine.images.check_load(folder)
    with pytest.warns(EngineDeprecationWarning, match=r"Engine\.check_load\(\)"):
        plan = engine.check_load(folder)
    assert plan.to_dict() == ticket.plan.to_dict()


def test_calling_the_datasets_part_is_the_old_datasets_method(engine: Engine) -> None:
    with pytest.warns(EngineDeprecationWarning, match=r"Engine\.datasets\(\) .* use Engine\.datasets\.list\(\)"):
        assert engine.datasets() == engine.datasets.list() == []


def test_a_shim_raises_once_its_removal_release_arrives() -> None:
    shim = SHIMS["Engine.load()"]
    with pytest.warns(EngineDeprecationWarning):
        deprecate(shim, version="0.2.9")
    for arrived in (shim.removed_in, "0.3.1", "1.0.0", "0.3.0.dev1"):
        with pytest.raises(ShimExpired, match=r"Engine\.load\(\) was to be removed in 0\.3\.0"):
            deprecate(shim, version=arrived)
    assert version_tuple("0.3.0rc1") == (0, 3, 0) and version_tuple("0.10") > version_tuple("0.9.9")


def test_no_shim_outlives_its_release() -> None:
    """The guard itself: the release that reaches a shim's ``removed_in`` fails here until it is deleted."""
    assert SHIMS, "the shims register when the facade is imported"
    late = [f"{s.old} (removed in {s.removed_in})" for s in SHIMS.values()
            if version_tuple(__version__) >= version_tuple(s.removed_in)]
    assert not late, f"delete these shims before releasing {__version__}: {late}"


def test_the_migration_notes_list_every_shim() -> None:
    notes = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    missing = [s.old for s in load_register().values() if f"`{s.old.removesuffix('()')}`" not in notes]
    assert not missing, missing


def test_the_migration_notes_carry_the_register_as_it_is() -> None:
    """docs/migration.md's table is the register rendered (``python -m engine.deprecation``)."""
    load_register()
    notes = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert notes == page_with_register(notes), "the register changed: run python -m engine.deprecation"


def test_the_register_holds_every_kind_of_old_spelling() -> None:
    kinds = {shim.kind for shim in load_register().values()}
    assert kinds == {"engine", "plugin", "module", "flag", "setting"}, kinds
    assert len(SHIMS) >= 100


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def test_no_old_spelling_warns_outside_the_register() -> None:
    """Every deprecation the tree gives goes through the register's one ``deprecate``: no other
    ``warnings.warn`` of a deprecation category, no deprecation worded in a print, no second function
    called ``deprecate``, and every spelling a call names is a row."""
    rows = load_register()
    found = []
    for path in [*ROOT.glob("engine/**/*.py"), *ROOT.glob("families/**/*.py"), *ROOT.glob("examples/**/*.py")]:
        if path == ROOT / "engine" / "deprecation.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "deprecate":
                found.append(f"{where}:{node.lineno} defines another deprecate")
        for call in _calls(tree):
            words = ast.unparse(call)
            if _name(call.func) in ("warn", "warn_explicit") and any(
                    c in words for c in ("DeprecationWarning", "FutureWarning")):
                found.append(f"{where}:{call.lineno} warns outside the register: {words[:80]}")
            said = " ".join(str(c.value) for c in ast.walk(call) if isinstance(c, ast.Constant)).lower()
            if _name(call.func) == "print" and "deprecated" in said and ("removed" in said or " is now " in said):
                found.append(f"{where}:{call.lineno} prints its own deprecation (the register words them)")
            if _name(call.func) == "deprecate" and call.args and isinstance(call.args[0], ast.Constant):
                if call.args[0].value not in rows:
                    found.append(f"{where}:{call.lineno} deprecates {call.args[0].value!r}, not a row")
    assert not found, "\n".join(found)


def test_a_renamed_flag_and_an_alias_module_warn_with_their_row(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib
    import sys

    from engine.cli import main
    from engine.deprecation import PluginDeprecationWarning

    main(["plan", "--model-family", "sdxl", "--hardware", "rtx4090", "--json"])
    assert f"warning[deprecated]: {SHIMS['--model-family'].message()}" in capsys.readouterr().err
    sys.modules.pop("engine.types", None)
    with pytest.warns(PluginDeprecationWarning, match=r"engine\.types is a spelling of an earlier plugin API.*"
                      r"use engine\.contract\.types .* removed in 0\.4\.0"):
        importlib.import_module("engine.types")


def test_the_facade_is_composed_not_mixed_in() -> None:
    """``Engine`` inherits nothing but object; its parts are classes of their own that share no base."""
    assert Engine.__mro__ == (Engine, object)
    engine = Engine(hardware=preset("cpu"))
    parts = [engine.loaded, engine.images, engine.videos, engine.training, engine.datasets, engine.catalog]
    assert all(type(part).__mro__[1:] == (object,) for part in parts)
    assert engine.loaded._slot is engine.training._slot  # noqa: SLF001 - one job slot for every GPU job
    assert engine.images._loaded is engine.videos._loaded is engine.loaded  # noqa: SLF001 - one loaded model


class _Namespaced:
    """An engine seen through its parts only: ``e.families()`` -> ``e.catalog.families()``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        part, new_name = MOVED[name].path.split(".")
        return getattr(getattr(self._engine, part), new_name)


def _plain(answer: object) -> object:
    return answer.to_dict() if hasattr(answer, "to_dict") else answer
