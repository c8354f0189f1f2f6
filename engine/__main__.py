"""``python -m engine``: the same CLI as ``diffusion-engine``."""

from engine.cli import main

raise SystemExit(main())
