"""The qwen_image family plugin: table.py (data), hooks.py (entry point), tiny.py (tiny pipeline)."""
