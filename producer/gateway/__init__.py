"""The OpenAI-compatible HTTP gateway (``tokenfleet serve``): an ASGI app on the async client.

Stateless: every request it accepts lives in Redis (queue entry, durable record, token list), so
any number of gateway processes can stand behind a load balancer and any of them can resume any
stream. Modules: ``settings`` (what ``serve`` reads), ``app`` (the FastAPI app and its
lifespan), ``openai_api`` (request bodies → submit arguments), ``responses`` (events → OpenAI
response and chunk objects), ``streams`` (the SSE generators), ``routes`` (the endpoints),
``errors`` (the OpenAI error shape), ``limits`` (body size), ``drain`` (Retry-After from the
observed drain rate), ``identity`` (request ids, ownership), ``metrics``, ``auth`` (API keys and
quotas).
"""
