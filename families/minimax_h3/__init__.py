"""MiniMax-H3: video with 32 kHz stereo sound (MiniMax), a built-in family plugin run through
diffusers' modular pipeline."""
