"""Training memory accuracy: a LoRA training step measured against the estimate.

The tool itself is :mod:`engine.testing.memory_figures` (installed with the
engine, for the built-in families and any plugin family whose table has a
``MemoryProbe``); this script runs it from the clone:

    nice -n 10 .venv/bin/python bench/memory_accuracy.py --derive [--families flux]
    nice -n 10 .venv/bin/python bench/memory_accuracy.py [--families flux] [--validate | --skip-validation]
"""

from __future__ import annotations

from engine.testing.memory_figures import main

if __name__ == "__main__":
    main()
