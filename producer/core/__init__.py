"""The producer's logic, written once and free of I/O: validation and encoding (``request``),
the client's and the handle's operations as plans (``client_core``, ``handle_core``) in the
vocabulary of ``effects``, merging catch-up reads with live messages (``cursor``), and the
bookkeeping of a shared pub/sub connection (``subscriptions``). ``sync_io`` and ``async_io``
perform the plans; ``Client`` / ``AsyncClient`` and ``Handle`` / ``AsyncHandle`` are thin faces.
"""
