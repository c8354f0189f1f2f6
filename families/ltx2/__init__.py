"""LTX-2: video with synchronised sound (Lightricks), a built-in family plugin."""
