"""The fleet console (issue 32, docs/console.md): a live web page of queues, workers, KV pools,
requests, batches, API keys and dead letters, served by the gateway at ``/console`` and by
``tokenfleet console`` for a fleet without one.

One room per concern:

* :mod:`.view` — ``ConsoleData``: what the page shows, read through the client's own plans
  (``AsyncClient.fleet_status()`` is what ``tokenfleet status --json`` prints) and the actions;
* :mod:`.live` — ``LiveFeed``: one reading per period shared by every open console;
* :mod:`.access` — who may look (a viewer or admin key) and who may act (admin);
* :mod:`.render` and ``templates/`` — server-rendered HTML (Jinja2, everything escaped);
* :mod:`.routes` — the HTTP surface; :mod:`.app` — mounting it on an app, and the standalone
  app of ``tokenfleet console``;
* ``static/`` — the page's own script and style, and ``static/vendor/``: htmx, its SSE
  extension and uPlot, copied from their npm packages at build time
  (``scripts/console_assets.py``; pinned with integrity in ``web/package-lock.json``).
"""
