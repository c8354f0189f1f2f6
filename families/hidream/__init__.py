"""The HiDream-I1 family plugin (``HiDreamImagePipeline``: four text encoders, a mixture-of-experts DiT)."""
