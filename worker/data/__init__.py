"""Data files shipped with the worker (the tiny model's tokenizer corpus)."""
