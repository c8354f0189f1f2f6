"""What every command shares: exit codes, the help format, messages in the terminal's words."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

from engine import requests
from engine.requests import FIELD_FLAGS, Control, in_flag_words

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
DOWNLOAD_HELP = ("allow downloading a hub model that is not in the local cache (its size is printed "
                 "first); or set DIFFUSION_ENGINE_ALLOW_DOWNLOAD=1")


def flag_words(message: str, overrides: Mapping[str, str] | None = None) -> str:
    """``Pass quant=int8`` -> ``Pass --quant int8``: engine messages name request fields;
    at the terminal the user typed flags (``overrides``: a command's own spellings)."""
    return in_flag_words(message, {**FIELD_FLAGS, **(overrides or {})})


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and default not in (None, False, [], argparse.SUPPRESS)
            and action.option_strings
        ):
            text += f" (default: {default})"
        return text


#: The error code of a command line the parser cannot take (its row: docs/errors.md).
USAGE_CODE = "usage"


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as ``error[usage]: ...`` (exit 2) like every other refusal."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"error[{USAGE_CODE}]: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """An unknown flag is named first (with the nearest known one), before argparse's own
        checks: ``--modle x`` is not reported as a missing ``--model``."""
        if not self._subparsers:  # a command's own parser sees every flag it will be given
            self._name_unknown_flags(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _name_unknown_flags(self, args: list[str]) -> None:
        import difflib

        known = [o for o in self._option_string_actions if o.startswith("--")]
        for token in args:
            if token == "--":
                return
            if not token.startswith("--"):
                continue
            flag = token.split("=", 1)[0]
            if flag in self._option_string_actions or any(o.startswith(flag) for o in known):
                continue  # exact, or an abbreviation argparse expands
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            self.error(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else "")
                       + f"; {self.prog} --help lists its flags")


def port_number(text: str) -> int:
    """A TCP port: 0-65535 (argparse names the flag when it is not)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


def download_allowed(args: argparse.Namespace) -> bool:
    """``--allow-download``, or ``DIFFUSION_ENGINE_ALLOW_DOWNLOAD=1``: the user's consent to a download."""
    return requests.download_allowed(bool(getattr(args, "allow_download", False)))


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' own log lines and warnings")


def add_controls(parser: argparse.ArgumentParser | argparse._ArgumentGroup, controls: Iterable[Control]) -> None:
    """One flag per row of the control table; a row with a ``group`` is listed under that heading."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for control in controls:
        target = parser
        if control.group is not None and isinstance(parser, argparse.ArgumentParser):
            if control.group not in groups:
                groups[control.group] = parser.add_argument_group(control.group)
            target = groups[control.group]
        target.add_argument(control.flag, **control.argparse_kwargs())  # type: ignore[arg-type]
