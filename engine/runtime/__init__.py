"""Applying a plan with the real libraries: torch, diffusers, torchao, bitsandbytes.

Everything here imports torch; nothing below ``engine.runtime`` is imported
by the policy layer or the light CLI commands.
"""
