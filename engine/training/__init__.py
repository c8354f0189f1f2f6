"""LoRA training: config, preflight, the generic trainer loop, the child process, run records.

``config`` and ``preflight`` import no torch; the trainer and its precision
setup do, and run in a spawned child process.
"""
