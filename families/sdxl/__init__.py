"""The sdxl family plugin: table.py (data), hooks.py (entry point), tiny.py (tiny pipeline)."""
