"""Shared KV pools (issue 6, docs/kv-pools.md): the pool wing of the worker.

One folder for everything about a pool, from the Redis scripts up to the CLI:

* ``lua/`` — the atomic accounting scripts, one ``.lua`` file each with its KEYS/ARGV header;
* :mod:`.scripts` — loads them once, and the pool's ``KEYS`` (the accounting rules are in its
  docstring);
* :mod:`.config` — :class:`~.config.PoolConfig` and the pool's limits;
* :mod:`.orders`, :mod:`.grant` — what a step asks and what the pool answers;
* :mod:`.chunking` — how much to ask ahead and give back (:func:`~.chunking.plan_blocks`);
* :mod:`.member` — :class:`~.member.KVPoolMember`, the scripts' client;
* :mod:`.admin` — create, list, inspect a pool; its manual clock;
* :mod:`.compute_share` — the token bucket that paces a member to its compute share;
* :mod:`.link` — :class:`~.link.PoolLink`, which keeps one engine within its share through the
  engine's one pool-facing object (``tokenfleet.worker.engine.pool_port.PoolPort``);
* :mod:`.commands` — ``tokenfleet pool create|show``.
"""
