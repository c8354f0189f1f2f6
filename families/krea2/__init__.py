"""Krea 2: Raw and its 8-step Turbo (Krea), a built-in family plugin."""
