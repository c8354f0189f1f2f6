"""The HunyuanImage 2.1 family plugin (``HunyuanImagePipeline``: 2K-native, a 32x VAE, guiders)."""
