"""FLUX.2: dev (the 32B transformer, Mistral-Small encoder) and klein 4B (Qwen3 encoder)."""
