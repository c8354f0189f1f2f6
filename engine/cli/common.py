"""What every command shares: exit codes, the help format, messages in the terminal's words."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from typing import NoReturn

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130
DOWNLOAD_HELP = ("allow downloading a hub model that is not in the local cache (its size is printed "
                 "first); or set DIFFUSION_ENGINE_ALLOW_DOWNLOAD=1")

#: ``name=value`` as the engine's messages spell a request field -> the flag a terminal user types.
FIELD_FLAGS: dict[str, str] = {
    "dtype": "--dtype", "quant": "--quant", "memory": "--memory", "attention": "--attention",
    "step_cache": "--step-cache", "compile": "--compile", "speed": "--speed", "steps": "--steps",
    "threads": "--threads", "family": "--model-family", "base": "--base", "device": "--device",
    "text_encoder_quant": "--text-encoder-quant", "text_encoder_memory": "--text-encoder-memory",
    "vae_tiling": "--vae-tiling",
}


def flag_words(message: str, overrides: Mapping[str, str] | None = None) -> str:
    """``Pass quant=int8`` -> ``Pass --quant int8``: engine messages name API fields;
    at the terminal the user typed flags (``overrides``: a command's own spellings)."""
    flags = {**FIELD_FLAGS, **(overrides or {})}
    names = "|".join(sorted(flags, key=len, reverse=True))
    return re.sub(r"(?<![\w.-])(" + names + r")=([\w.-]+)",
                  lambda m: f"{flags[m.group(1)]} {m.group(2)}", message)


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


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as ``error[usage]: ...`` (exit 2) like every other refusal."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"error[usage]: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED)


def download_allowed(args: argparse.Namespace) -> bool:
    """``--allow-download``, or ``DIFFUSION_ENGINE_ALLOW_DOWNLOAD=1``: the user's consent to a download."""
    from engine.preflight.hub import download_allowed_by_env

    return bool(getattr(args, "allow_download", False)) or download_allowed_by_env()


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' own log lines and warnings")
