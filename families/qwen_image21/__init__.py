"""Qwen-Image 2.1: generation and editing in one pipeline, RGBA in and out (a built-in family plugin)."""
