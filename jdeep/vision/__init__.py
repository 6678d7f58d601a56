"""DeepSeek-V4.1's vision tower: the image processor (host), the ViT and aligner (jnp programs) and its weights."""
