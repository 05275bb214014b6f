"""Lua scripts, each a constant with a KEYS/ARGV header, and the registry that runs them."""
