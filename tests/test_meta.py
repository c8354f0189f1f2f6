"""Meta-tests, as datasette has them: every hook is documented and exercised."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from engine import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("engine_") and callable(f))


def test_there_are_hooks() -> None:
    assert len(HOOKS) >= 8


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_its_signature(hook: str) -> None:
    arguments = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert f"### `{hook}({arguments})`" in DOCS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test_named_after_it(hook: str) -> None:
    sources = [ROOT / "engine" / "testing" / "contract.py", *ROOT.glob("tests/test_*.py")]
    sources += ROOT.glob("families/*/tests/test_*.py")
    pattern = re.compile(rf"def (test_{hook}\w*)\(")
    assert any(pattern.search(p.read_text(encoding="utf-8")) for p in sources), hook


def test_engine_names_no_family() -> None:
    """The core is family-agnostic: family names live in families/ only."""
    names = re.compile(r"\b(flux|qwen|zimage|z-image|sdxl)\b", re.IGNORECASE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "engine").rglob("*.py")
        if names.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []
