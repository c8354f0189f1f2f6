"""The type check runs in the suite: the core strictly, the rest held to a baseline that only shrinks.

See :mod:`engine.testing.typecheck` for the two runs and how the baseline is rewritten.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import pytest

from engine.testing import typecheck

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mypy_with_no_arguments_checks_the_core_strictly_and_passes(tmp_path: Path) -> None:
    """``python -m mypy`` reads ``[tool.mypy]``: strict over the contract, the requests and the policy."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    assert config["strict"] is True
    assert config["files"] == ["engine/contract", "engine/requests", "engine/policy"]
    result = typecheck.run_mypy(cache_dir=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


@pytest.mark.slow
def test_the_rest_of_the_engine_holds_to_its_baseline(tmp_path: Path) -> None:
    """No error outside the core that the baseline does not list, and none listed that is gone."""
    found, baseline = typecheck.rest_findings(cache_dir=tmp_path), typecheck.read_baseline()
    new, gone = found - baseline, baseline - found
    assert not new, "new type errors (fix them; the baseline only shrinks):\n" + "\n".join(sorted(new.elements()))
    assert not gone, ("fixed, still listed: run python -m engine.testing.typecheck --write\n"
                      + "\n".join(sorted(gone.elements())))


def test_the_baseline_check_sees_a_new_error_and_a_fixed_one() -> None:
    """The comparison itself: a finding not in the baseline is new; a listed one not found is gone."""
    output = ("engine/x.py:3: error: Incompatible return value type  [return-value]\n"
              "engine/x.py:9:5: error: Incompatible return value type  [return-value]\n"
              "engine/x.py:9: note: a note is not an error\nFound 2 errors in 1 file\n")
    found = typecheck.findings(output)
    assert found == Counter({"engine/x.py: Incompatible return value type  [return-value]": 2})
    baseline = Counter({"engine/x.py: Incompatible return value type  [return-value]": 1,
                        "engine/y.py: gone  [misc]": 1})
    assert sum((found - baseline).values()) == 1 and list(baseline - found) == ["engine/y.py: gone  [misc]"]


def test_the_strict_config_catches_a_planted_error(tmp_path: Path) -> None:
    """The strict run is not vacuous: under pyproject's config an untyped function fails."""
    planted = tmp_path / "planted.py"
    planted.write_text("def untyped(x):\n    return x\n", encoding="utf-8")
    result = typecheck.run_mypy("--config-file", str(ROOT / "pyproject.toml"), str(planted),
                                cache_dir=tmp_path / "cache")
    assert result.returncode == 1 and "planted.py" in result.stdout and "no-untyped-def" in result.stdout
