"""Applying a plan with the real libraries: torch, diffusers, torchao, bitsandbytes.

Everything here imports torch but :mod:`engine.runtime.protocol` (the
``Session`` protocol the facade types against); nothing else below
``engine.runtime`` is imported by the policy layer or the light CLI commands.
"""
