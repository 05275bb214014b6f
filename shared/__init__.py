"""What producer and worker agree on: settings, key names, the wire schema, Lua scripts, errors.

Nothing in this package imports torch: a web app installs the producer without the model stack.
"""
