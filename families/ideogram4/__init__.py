"""The Ideogram 4 family plugin (``Ideogram4Pipeline``: a conditional and an unconditional transformer)."""
