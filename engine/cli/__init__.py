"""``diffusion-engine``: the terminal interface, a thin face over :class:`engine.Engine`.

Every command has ``--json``. Bad input (a flag out of bounds, an unknown
family or preset, a doomed request) prints ``error[code]: message`` on
stderr and exits 2, never a traceback, and is found before any model loads:
the flags build the same request models the HTTP API validates
(:mod:`engine.requests`), and a problem names the flag that was typed. An
explicit request the engine overrides prints ``warning[code]: ...`` (exit 2
with ``--strict``). Library chatter stays hidden unless ``-v``; a closed
pipe and Ctrl-C (130) end quietly.

The light commands (``families``, ``info``, ``plan``) import no torch on a
machine without a GPU: they answer in a fraction of a second.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.cli.started import PROCESS_STARTED  # first: the clock generate's start-up reads

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answered before the request models (pydantic) are built: ~0.03 s
        from engine import __version__

        print(f"diffusion-engine {__version__}")
        return 0
    import json
    import os

    from engine.cli.common import EXIT_INTERRUPTED, EXIT_REFUSED, flag_words
    from engine.cli.parser import build_parser
    from engine.errors import EngineError

    verbose = any(arg in ("-v", "--verbose") for arg in argv)
    if not verbose:
        from engine.logs import quiet_library_logs

        quiet_library_logs(warnings_too=True)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_REFUSED
    args.verbose = verbose  # -v before or after the command
    if hasattr(args, "runs_dir") and args.runs_dir is None:
        from engine.requests import default_runs_dir

        args.runs_dir = default_runs_dir()
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_REFUSED
    try:
        return int(args.run(args) or 0)
    except EngineError as exc:
        message = flag_words(exc.message, getattr(args, "field_flags", None))
        if getattr(args, "field_names", None) is not None:  # a command whose messages name its config's fields
            message = args.field_names(message)
        if getattr(args, "json", False):
            print(json.dumps({"error": {**exc.to_dict(), "message": message}}, indent=2))
        print(f"error[{exc.code}]: {message}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): stop writing, say nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
