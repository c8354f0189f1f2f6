"""When the CLI began: ``engine.cli`` imports this first, so ``generate`` can report the
start-up before the model's load (Python, imports) apart from loading it."""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()
