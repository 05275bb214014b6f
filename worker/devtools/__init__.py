"""Demo and developer tooling: everything that runs the project locally, none of it the service.

* ``local_redis`` finds or starts a private redis-server (the demo, the test suite, benchmarks);
* ``testing`` holds harnesses for the tests and benchmarks only: a private Redis Sentinel setup
  and Redis Cluster on loopback ports, throwaway TLS certificates (tests/ha, the cluster
  benchmark);
* ``local_fleet`` starts and stops worker processes on this machine (demo, end-to-end benchmark);
* ``tiny_model`` builds the project's tiny random model (tests, demo, benchmarks, compose);
* ``commands`` holds the ``demo``, ``make-tiny-model`` and ``bench`` subcommands.

Dependency direction: this package may use the service and the producer; the service
(``tokenfleet.worker`` outside ``devtools``, including ``tokenfleet worker`` and ``status``)
never imports from it (tests/devtools/test_boundary.py checks it). Importing this package
imports nothing else; torch and transformers load only inside the functions that need them.
"""
