"""The engine's type check, as ``make test`` runs it (``tests/house/test_types.py``).

Two mypy runs, each cold in seconds (torch and the other heavy libraries are
read as Any, so the engine's own types are checked, not theirs):

- **the core, strictly**: ``python -m mypy`` with no arguments checks what
  ``[tool.mypy]`` in pyproject names (the plugin contract, the request
  vocabulary and the policy) and must exit 0;
- **the rest, held to a baseline**: ``tests/mypy-rest.ini`` runs the default
  checks over the other rooms; what it finds is listed in
  ``tests/mypy_baseline.txt`` (one line per error, without line numbers, so
  moving code does not churn it). A new error fails the test; so does an
  error that is gone but still listed, so the baseline only ever shrinks.
  ``python -m engine.testing.typecheck --write`` rewrites it after a fix.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REST_CONFIG = ROOT / "tests" / "mypy-rest.ini"
BASELINE = ROOT / "tests" / "mypy_baseline.txt"

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: (?P<message>.*)$")


def run_mypy(*args: str, cache_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m mypy ARGS`` from the repository root, with its own cache (a fresh one by default)."""
    with tempfile.TemporaryDirectory(prefix="mypy-cache-") as fresh:
        cache = ["--cache-dir", str(cache_dir or fresh)]
        return subprocess.run([sys.executable, "-m", "mypy", *cache, *args], cwd=ROOT,
                              capture_output=True, text=True, check=False)


def findings(output: str) -> Counter[str]:
    """Each error as ``path: message  [code]``, counted; notes and the summary dropped."""
    found: Counter[str] = Counter()
    for line in output.splitlines():
        match = _ERROR.match(line.strip())
        if match:
            found[f"{match['path']}: {match['message']}"] += 1
    return found


def rest_findings(cache_dir: Path | None = None) -> Counter[str]:
    """What mypy finds outside the strict core today."""
    return findings(run_mypy("--config-file", str(REST_CONFIG), cache_dir=cache_dir).stdout)


def read_baseline(path: Path = BASELINE) -> Counter[str]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return Counter(line for line in lines if line and not line.startswith("#"))


def write_baseline(found: Counter[str], path: Path = BASELINE) -> None:
    header = ["# mypy's findings outside the strict core (tests/mypy-rest.ini), one line per error.",
              "# It may only shrink: python -m engine.testing.typecheck --write after a fix."]
    path.write_text("\n".join(header + sorted(found.elements())) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.testing.typecheck", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite tests/mypy_baseline.txt from today's findings")
    args = parser.parse_args(argv)
    found, baseline = rest_findings(), read_baseline()
    if args.write:
        if found - baseline:
            print("refusing to grow the baseline; fix these instead:", *sorted((found - baseline).elements()),
                  sep="\n  ", file=sys.stderr)
            return 1
        write_baseline(found)
        print(f"{BASELINE.relative_to(ROOT)}: {sum(found.values())} errors (was {sum(baseline.values())})")
        return 0
    print(f"{sum(found.values())} errors outside the core; baseline {sum(baseline.values())}")
    return 0 if found == baseline else 1


if __name__ == "__main__":
    raise SystemExit(main())
