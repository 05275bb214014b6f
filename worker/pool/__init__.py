"""Shared KV pools (issue 6, docs/kv-pools.md): the pool wing of the worker.

One folder for a pool's member and administrator, up to the CLI. The pool's protocol — its
atomic accounting scripts (one ``.lua`` file each with its KEYS/ARGV header), their ``KEYS`` and
the parse of the inspect reply — is in :mod:`tokenfleet.shared.pool`, because producers read
pools too (``tokenfleet status``, the console) and a producer never imports the worker:

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
