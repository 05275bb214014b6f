"""Where a worker's model comes from: short names, GGUF files converted once into a cached
Hugging Face folder, local folders and hub ids found offline (``resolve.resolve_model``)."""
