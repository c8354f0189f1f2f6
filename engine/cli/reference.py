"""``docs/cli.md``: every command's ``--help``, generated from the parser itself.

``python -m engine.cli.reference`` writes it; a test keeps it current, so the
reference never describes a flag the CLI does not have.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli.parser import build_parser

HEADER = """# CLI reference

Every command's `--help`, generated from the parser (`python -m engine.cli.reference`).
Flags that are request controls link to their JSON fields in [controls.md](controls.md).
"""


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """(command words, its parser) for every command and sub-command, depth first."""
    found = [(prefix, parser)]
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prefix} {name}".strip())
    return found


def render() -> str:
    """The page, wrapped at 100 columns whatever the terminal (argparse reads ``COLUMNS``)."""
    import os

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        sections = [HEADER]
        for words, parser in _commands(build_parser(), ""):
            parser.prog = f"diffusion-engine {words}".strip()
            title = words or "(global options)"
            sections.append(f"## {title}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        return "\n".join(sections)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def main(argv: list[str] | None = None) -> int:
    from engine.generated_docs import write_page

    return write_page("cli.md", render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
