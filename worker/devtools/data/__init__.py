"""Data files shipped with the dev tooling (the tiny model's tokenizer corpus)."""
