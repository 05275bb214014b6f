"""The API-key scripts: ``.lua`` files loaded by :mod:`tokenfleet.producer.gateway.auth.scripts`."""
