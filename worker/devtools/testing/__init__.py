"""Harnesses for the test suite and the benchmarks, never for a deployment.

* ``local_sentinel`` starts a private Redis Sentinel setup (1 primary, 1 replica, 3 sentinels)
  on loopback ports, optionally with passwords and TLS;
* ``local_cluster`` starts a private Redis Cluster (3 primaries + 3 replicas) on loopback ports
  and drives its failovers, crashes and slot migrations;
* ``local_tls`` writes throwaway TLS certificates (a CA whose key sits next to them).

tests/ha and benchmarks/bench_cluster.py use them; docs/redis-modes.md shows how to try a mode
locally with them. Nothing outside the tests, the benchmarks and this package imports them.
"""
