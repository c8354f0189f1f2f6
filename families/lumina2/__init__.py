"""Lumina 2 (Lumina-Image 2.0, Alpha-VLLM), a built-in family plugin."""
