"""``make demo``: what the engine decides on this machine, and on another.

Runs the real CLI entry points in this process: this machine's info, then
the same questions asked of an RTX 4090, the machine most users have.
"""

from __future__ import annotations

from engine.cli import main as cli


def main() -> int:
    print("== diffusion-engine on this machine ==")
    status = cli(["info"])
    print("\n== the same questions, asked of an RTX 4090 (--hardware rtx4090) ==")
    return status or cli(["info", "--hardware", "rtx4090"])


if __name__ == "__main__":
    raise SystemExit(main())
