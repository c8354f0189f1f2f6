"""The faces reach the engine through one door, and speak one vocabulary.

- Every import in ``engine/cli/`` and ``engine/server/`` (top-level and lazy,
  inside functions) names only the facade (``engine``), the request vocabulary
  (``engine.requests``), the errors, the log quieting the terminal uses, or the
  face's own modules: a capability or a check a face fetched itself would
  answer differently at another door.
- The control table is the one spelling of a control: the plan request
  model's fields, the CLI's flags and the docs' tables come from it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine.cli.parser import build_parser
from engine.requests import (
    GENERATE_CONTROLS,
    MODEL_CONTROLS,
    PLAN_CONTROLS,
    TRAIN_CONTROLS,
    PlanControls,
    in_flag_words,
    markdown_table,
)
from engine.requests.controls import PLAN_KEY_FLAGS

ROOT = Path(__file__).resolve().parents[2]
FACES = ("engine/cli", "engine/server")
#: What a face may import from the engine: the facade, the vocabulary, the errors, log quieting,
#: the generated pages' writer (a leaf that writes a rendered string: docs/cli.md is the CLI's)
#: the loopback and confinement tests every check shares (standard-library leaves), and the
#: register of old spellings (a renamed flag or setting is a row of it).
ALLOWED = re.compile(
    r"^engine(\.requests(\..*)?|\.errors|\.logs|\.generated_docs|\.network|\.places|\.deprecation|\.cli(\..*)?"
    r"|\.server(\..*)?)?$")
#: Names a face may take from the ``engine`` package itself.
FACADE_NAMES = {"Engine", "__version__", "requests"}


def _engine_imports(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every import of the engine in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "engine"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            if node.module == "engine":
                found += [(node.lineno, f"engine.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _face_files() -> list[Path]:
    return sorted(p for face in FACES for p in (ROOT / face).rglob("*.py"))


def test_the_faces_import_only_the_facade_the_requests_and_the_errors() -> None:
    offenders = []
    for path in _face_files():
        for line, module in _engine_imports(path):
            if module.startswith("engine.") and module.removeprefix("engine.") in FACADE_NAMES:
                continue
            if not ALLOWED.match(module):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == []


def test_the_import_walk_sees_lazy_imports(tmp_path: Path) -> None:
    """The walk would catch a face that imports past the facade inside a function."""
    face = tmp_path / "face.py"
    face.write_text("def f():\n    from engine.training.records import list_runs\n    import engine.runtime.session\n")
    found = [module for _, module in _engine_imports(face)]
    assert found == ["engine.training.records", "engine.runtime.session"]
    assert not any(ALLOWED.match(module) for module in found)


def test_the_plan_request_has_one_field_per_plan_control() -> None:
    fields = PlanControls.model_fields
    assert list(fields) == [c.field for c in PLAN_CONTROLS]
    for control in PLAN_CONTROLS:
        assert fields[control.field].default == control.default, control.field
    # Every control the plan reports that a user can ask for names its flag.
    assert set(PLAN_KEY_FLAGS.values()) <= {c.flag for c in PLAN_CONTROLS}


def _flags(command: str) -> dict[str, str]:
    """Flag -> argparse dest of one command of the real parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "==SUPPRESS==" or getattr(a, "choices", None))
    command_parser = sub.choices[command]  # type: ignore[index]
    return {flag: action.dest for action in command_parser._actions for flag in action.option_strings}


@pytest.mark.parametrize(("command", "controls"), [
    ("plan", (*MODEL_CONTROLS, *PLAN_CONTROLS)),
    ("generate", (*[c for c in MODEL_CONTROLS if c.field != "checkpoint"],
                  *[c for c in PLAN_CONTROLS if c.field != "steps"], *GENERATE_CONTROLS)),
    ("train", TRAIN_CONTROLS),
])
def test_every_control_is_a_flag_whose_destination_is_its_field(command: str, controls: tuple) -> None:
    flags = _flags(command)
    for control in controls:
        assert flags.get(control.flag) == control.field, (command, control.flag)


def test_choices_are_checked_at_the_edge_for_every_face() -> None:
    """``--quant int4`` and ``{"quant": "int4"}`` are refused by the same model, before any plan."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        PlanControls.model_validate({"quant": "int4"})
    assert refused.value.errors()[0]["loc"] == ("quant",)


@pytest.mark.parametrize(("message", "terminal"), [
    ("Pass quant=int8 instead", "Pass --quant int8 instead"),
    ("base_precision 'int4' is not one of auto, bf16", "--base-precision 'int4' is not one of auto, bf16"),
    ("mixed_precision=bf16 needs native bf16", "--mixed-precision bf16 needs native bf16"),
    ("image: no such file", "--image: no such file"),
    ("use device=cpu to train here", "use --device cpu to train here"),
    ("lora_rank: must be at most 1024", "--rank: must be at most 1024"),
    ("/data/my_base_precision/x stays a path", "/data/my_base_precision/x stays a path"),
])
def test_a_refusal_names_the_flag_at_the_terminal(message: str, terminal: str) -> None:
    assert in_flag_words(message) == terminal


def test_the_docs_tables_are_the_control_table() -> None:
    """docs/controls.md holds the tables generated from the control table (regenerate with
    ``python -m engine.requests.docs``)."""
    from engine.requests.docs import render

    assert (ROOT / "docs" / "controls.md").read_text(encoding="utf-8") == render()


def test_every_help_line_comes_from_the_table() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()  # type: ignore[union-attr]
    for control in PLAN_CONTROLS:
        first_words = " ".join(control.help.split()[:3])
        assert first_words in " ".join(help_text.split()), control.flag
    assert markdown_table(PLAN_CONTROLS).count("\n") == len(PLAN_CONTROLS) + 1


def test_the_plans_provenance_keys_are_the_tables() -> None:
    """A control asked for is reported under the plan key its row names (``quant`` ->
    ``transformer_quant``): the policy's mapping and the table agree."""
    from engine.policy.plan import InferenceRequest, requested_by_control

    for control in PLAN_CONTROLS:
        if control.plan_key is None or control.field == "prompt_cache":
            continue
        value = control.choices[-1] if control.choices else 3
        asked = requested_by_control(InferenceRequest(**{control.field: value}))
        assert asked[control.plan_key] == value, control.field
