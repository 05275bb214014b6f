"""A shared KV pool's protocol (issue 6, docs/kv-pools.md): its Lua scripts and their keys
(:mod:`.scripts`) and the parse of the read-only inspect reply (:mod:`.view`).

The worker's pool wing (``tokenfleet.worker.pool``) is the pool's member and administrator; a
producer (``tokenfleet status``, the console) reads a pool through this package alone.
"""
