"""Cheap, CPU-only checks that run before anything is evicted or loaded."""
