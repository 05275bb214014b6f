"""The HTTP gateway (``tokenfleet serve``): an OpenAI-compatible front on the async client.

:mod:`.auth` holds its API keys and quotas; it imports no web framework, so it is usable (and
tested) on its own.
"""
